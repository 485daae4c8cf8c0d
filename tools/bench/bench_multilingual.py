"""Multilingual benchmarks (issue 35), each in one process run, written to docs/benchmarks-history.md:

- filters: the Debian Reference's sections in en, fr, de, es, it, pt, ja, zh (parallel text), the build's
  default chain (FineWeb's rules) before (every language judged as English, today's build) and after
  (language ID, per-language settings and word split): kept share and drops per filter, per language, on
  the test half of the sections (the other half calibrated the thresholds: tools/bench/calibrate_languages.py);
- langid: accuracy per language on held-out paragraphs (Debian FAQ, New Maintainers' Guide) and speed,
  for the default model (lid.176.ftz, first 600 characters) and the other candidates that are installed
  (py3langid, pycld2, lingua), beside the published figure for fastText lid.176;
- segmenters: our word split vs datatrove's cmn_Hani / jpn_Jpan tokenizers on the same paragraphs (MB/s);
- neardup: a near-duplicate set from Chinese and Japanese man pages and English Reference paragraphs
  (tools/bench/neardup_cjk.py), our dedup stages (the build's: signatures with the segmenters, buckets,
  verify, clusters) vs datatrove's four MinHash stages run per language as FineWeb-2 does
  (`MinhashDedupSignature(language="cmn_Hani" / "jpn_Jpan")`, spaCy with jieba / SudachiPy): recall per
  Jaccard range, precision, traps merged, wall time per language (median of --runs alternating runs);
- langid_step: CPU time of the language-ID step alone on those corpora (600 and 1000 characters);
- english: `datapipe build` of an English corpus (../shared/corpora) with `langid.enabled` true vs false,
  one worker, alternating runs: wall time per core.

    apt-get install <the packages listed in tools/bench/multilingual_corpus.py>
    python tools/bench/bench_multilingual.py [--only filters,langid,neardup,english] [--runs 3] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import history  # noqa: E402
from calibrate_languages import drop_reasons, parallel_docs  # noqa: E402
from multilingual_corpus import LANGS, heldout_paragraphs, man_paragraphs, reference_sections  # noqa: E402
from neardup_cjk import build_set, shingles  # noqa: E402
from neardup_runs import quality, run_dedup  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CORPORA = REPO.parent / "shared" / "corpora"
FILTERS = ("0_gopher_repetition", "1_gopher_quality", "2_c4", "3_fineweb")
# fastText lid.176.bin, 1000 sentences per language: Lingua's accuracy reports (github.com/pemistahl/lingua-py,
# accuracy-reports/fasttext/*.txt, as of 2025-03)
PUBLISHED = {"en": 100.0, "fr": 99.2, "de": 99.8, "es": 99.5, "it": 99.8, "pt": 99.4, "zh": 99.73, "ja": 99.76}


def bench_filters() -> dict:
    from multilingual_corpus import calibration_half

    docs = parallel_docs(half=None)
    test = {lang: [d for d in ds if not calibration_half(d.id.split("/", 1)[1])] for lang, ds in docs.items()}
    out = {}
    for mode in ("before", "after"):
        rows = {}
        for lang, ds in test.items():
            if mode == "before":
                saved = [dict(d.metadata) for d in ds]
                for d in ds:
                    d.metadata.clear()
            reasons = drop_reasons(ds, {})
            if mode == "before":
                for d, m in zip(ds, saved):
                    d.metadata.update(m)
            by_filter = {f: 0 for f in FILTERS}
            for r in reasons:
                if r is not None:
                    by_filter[FILTERS[r[0]]] += 1
            rows[lang] = {"docs": len(ds), "kept": sum(r is None for r in reasons) / len(ds), "drops": by_filter,
                          "identified": dict(sorted({d.metadata["language"]: 0 for d in ds}.items()))}
            for d in ds:
                rows[lang]["identified"][d.metadata["language"]] += 1
        out[mode] = rows
    return out


def bench_langid() -> dict:
    from datapipe.config import LangIdConfig
    from datapipe.langid import load_model

    data = {lang: heldout_paragraphs(lang, clean=True) for lang in LANGS}
    en_docs = list(reference_sections("en").values())
    model, n = load_model(LangIdConfig()), LangIdConfig().max_chars
    methods = {f"lid.176.ftz, first {n} chars (default)": lambda t: model.predict(t[:n])[0],
               "lid.176.ftz, first 1000 chars": lambda t: model.predict(t[:1000])[0],
               "lid.176.ftz, whole text": lambda t: model.predict(t)[0]}
    try:
        import py3langid

        methods["py3langid"] = lambda t: py3langid.classify(t)[0]
    except ImportError:
        pass
    try:
        import pycld2

        def cld2(t):
            try:
                return pycld2.detect(t)[2][0][1].split("-")[0]
            except Exception:  # noqa: BLE001 - cld2 refuses some byte sequences
                return "und"
        methods["pycld2"] = cld2
    except ImportError:
        pass
    out = {"paragraphs": {lang: len(v) for lang, v in data.items()}, "methods": {}}
    for name, f in methods.items():
        acc = {lang: sum(f(p) == lang for p in ps) / len(ps) for lang, ps in data.items()}
        t0 = time.perf_counter()
        for d in en_docs:
            f(d)
        dt = time.perf_counter() - t0
        mb = sum(len(d.encode()) for d in en_docs) / 1e6
        out["methods"][name] = {"accuracy": acc, "mb_s": mb / dt, "ms_per_3kb_doc": dt / len(en_docs) * 1000
                                * 3000 / (mb * 1e6 / len(en_docs))}
        print(f"langid {name}: {json.dumps({k: round(v, 3) for k, v in acc.items()})} {mb / dt:.2f} MB/s", flush=True)
    return out


def bench_segmenters() -> dict:
    """MB/s of our word split and of datatrove's (FineWeb-2's codes) on Chinese and Japanese man pages."""
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    from datapipe.wordtok import tokenize_words

    out = {}
    for lang, code in (("zh", "cmn_Hani"), ("ja", "jpn_Jpan")):
        docs = man_paragraphs(lang, 150)[:800]
        mb = sum(len(d.encode()) for d in docs) / 1e6
        dt_tok = load_word_tokenizer(code)
        for name, f in (("ours", lambda t, lg=lang: tokenize_words(t, lg)), (f"datatrove {code}", dt_tok.word_tokenize)):
            f(docs[0])  # loads dictionaries
            t0 = time.perf_counter()
            for d in docs:
                f(d + " ")  # not a memo hit
            out.setdefault(lang, {})[name] = mb / (time.perf_counter() - t0)
        print(f"segmenters {lang}: " + ", ".join(f"{k} {v:.2f} MB/s" for k, v in out[lang].items()), flush=True)
    return out


def bench_neardup(runs: int, pairs: int) -> dict:
    import logging

    from datatrove.utils.logging import logger

    logger.remove()
    logging.disable(logging.WARNING)
    bases = {lg: [p for p in man_paragraphs(lg, 150) + heldout_paragraphs(lg, clean=True) if 150 <= len(p) <= 1500]
             for lg in ("zh", "ja")}
    bases.update({
        "en": [p for p in heldout_paragraphs("en", clean=True) if len(p) >= 300]})
    t0 = time.perf_counter()
    texts, langs, prs, traps = build_set(bases, pairs)
    sets = [shingles(t, lg) for t, lg in zip(texts, langs)]
    print(f"near-dup set: {len(texts)} docs, {len(prs)} pairs, {len(traps)} trap pairs "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    report = {"docs": {lg: langs.count(lg) for lg in sorted(set(langs))}, "pairs": len(prs), "traps": len(traps)}
    allidx = list(range(len(texts)))
    with tempfile.TemporaryDirectory() as tmp:
        res = run_dedup(texts, langs, allidx, f"{tmp}/all", ours=True)
    report["ours_all"] = quality(res["cluster"], prs, traps, sets, langs)
    times: dict[str, dict[str, list[float]]] = {}
    dt_cluster = {}
    for lang, code in (("zh", "cmn_Hani"), ("ja", "jpn_Jpan")):
        idx = [i for i in allidx if langs[i] == lang]
        for r in range(runs):
            for name in ("ours", "datatrove"):
                with tempfile.TemporaryDirectory() as tmp:
                    got = run_dedup(texts, langs, idx, tmp, ours=name == "ours", dt_lang=code)
                times.setdefault(lang, {}).setdefault(name, []).append(got["seconds"])
                if name == "datatrove":
                    dt_cluster.update(got["cluster"])
            print(f"{lang} run {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times[lang].items()), flush=True)
    report["datatrove_per_language"] = quality(dt_cluster, prs, traps, sets, langs)
    report["seconds"] = {lang: {k: statistics.median(v) for k, v in t.items()} for lang, t in times.items()}
    report["speedup"] = {lang: t["datatrove"] / t["ours"] for lang, t in report["seconds"].items()}
    report["mb"] = {lang: sum(len(texts[i].encode()) for i in allidx if langs[i] == lang) / 1e6 for lang in ("zh", "ja")}
    return report


def bench_langid_step(runs: int) -> dict:
    """CPU seconds of the language-ID step alone (`IdentifyLanguage.run`, as the scan stage runs it) on the
    English corpora of bench_english, for the default 600 characters and for 1000, alternating."""
    import gzip

    from datatrove.data import Document

    from datapipe.config import LangIdConfig, SourceConfig
    from datapipe.langid import IdentifyLanguage

    docs = []
    for name in ("pydoc", "shakespeare", "fortunes"):
        with gzip.open(CORPORA / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            docs += [json.loads(x)["text"] for x in f]
    out: dict[int, list[float]] = {600: [], 1000: []}
    for _ in range(runs):
        for n in out:
            lid = IdentifyLanguage(LangIdConfig(max_chars=n), SourceConfig("s", ["-"]))
            c0 = time.process_time()
            for _ in lid.run(iter([Document(text=t, id="x") for t in docs])):
                pass
            out[n].append(time.process_time() - c0)
    res = {"docs": len(docs), "mb": sum(len(t.encode()) for t in docs) / 1e6,
           "cpu": {n: statistics.median(v) for n, v in out.items()}}
    print(f"langid step: {json.dumps(res)}", flush=True)
    return res


def bench_english(runs: int) -> dict:
    import gzip
    import shutil

    from datapipe.config import BuildConfig, LangIdConfig, SourceConfig, TokenizerConfig
    from datapipe.executorconfig import ExecutorConfig
    from datapipe.pipeline import Build
    from datapipe.tokenize import train_bpe

    root = Path(tempfile.mkdtemp(prefix="bench-ml-en-"))
    paths = []
    for name in ("pydoc", "shakespeare", "fortunes"):
        dst = root / f"{name}.jsonl"
        with gzip.open(CORPORA / f"{name}.jsonl.gz", "rb") as f, open(dst, "wb") as g:
            shutil.copyfileobj(f, g)
        paths.append(str(dst))
    texts = [json.loads(x)["text"] for x in open(paths[0], encoding="utf-8")][:500]
    tok = train_bpe(texts, 4096, "<|endoftext|>", str(root / "tok.json"))
    mb = sum(os.path.getsize(p) for p in paths) / 1e6
    secs: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for r in range(runs):
        for on in (False, True):
            out = root / f"out-{on}-{r}"
            cfg = BuildConfig(output=str(out), sources=[SourceConfig("en", paths)], tokenizer=TokenizerConfig(path=tok),
                              langid=LangIdConfig(enabled=on), executor=ExecutorConfig(workers=1))
            t0, c0 = time.perf_counter(), time.process_time()
            Build(cfg, workers=1).run(progress=False)  # one worker: every stage runs in this process
            secs[on].append(time.perf_counter() - t0)
            cpu[on].append(time.process_time() - c0)
            shutil.rmtree(out)
        print(f"english run {r + 1}: off {secs[False][-1]:.1f} s ({cpu[False][-1]:.1f} CPU s), "
              f"on {secs[True][-1]:.1f} s ({cpu[True][-1]:.1f} CPU s)", flush=True)
    shutil.rmtree(root)
    off, on = statistics.median(cpu[False]), statistics.median(cpu[True])
    return {"mb": mb, "off": off, "on": on, "slowdown": on / off - 1, "runs": cpu, "wall": secs}


def write_section(r: dict, args) -> None:
    cpu = platform.processor() or platform.machine()
    lines = ["", f"## datapipe: every language (issue 35) ({datetime.date.today().isoformat()})", "",
             f"Command: `python tools/bench/bench_multilingual.py --only {args.only} --runs {args.runs} "
             f"--pairs {args.pairs}`  ",
             f"Machine: {os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, one process (per-core "
             "figures; other jobs shared the machine). Text: Debian's documentation packages (see "
             "tools/bench/multilingual_corpus.py).", ""]
    if "filters" in r:
        f = r["filters"]
        n = f["after"]["en"]["docs"]
        lines += [f"**Filters on parallel text** (Debian Reference, the {n} test-half sections present in all eight "
                  "languages; the default chain). Kept share and documents dropped by each filter; before: every "
                  "document judged with English's settings, as by the build before this change (but with Chinese "
                  "and Japanese words segmented in both columns); after: language ID and per-language settings.", "",
                  "| language | kept before | kept after | after - English | " + " | ".join(
                      f"{x} before / after" for x in FILTERS) + " | identified as |",
                  "|---|---|---|---|" + "---|" * len(FILTERS) + "---|"]
        en = f["after"]["en"]["kept"]
        for lang in LANGS:
            b, a = f["before"][lang], f["after"][lang]
            lines.append(f"| {lang} | {b['kept']:.3f} | {a['kept']:.3f} | {a['kept'] - en:+.3f} | " + " | ".join(
                f"{b['drops'][x]} / {a['drops'][x]}" for x in FILTERS) + " | "
                + ", ".join(f"{k} {v}" for k, v in sorted(a["identified"].items(), key=lambda kv: -kv[1])) + " |")
        lines.append("")
    if "langid" in r:
        li = r["langid"]
        names = list(li["methods"])
        lines += ["**Language ID** on held-out paragraphs (Debian FAQ and New Maintainers' Guide; a paragraph counts "
                  "when its script, or its stop words, say it is in the package's language: "
                  + ", ".join(f"{k} {v}" for k, v in li["paragraphs"].items())
                  + "). Published: fastText lid.176.bin on 1,000 sentences per language (Lingua's accuracy "
                  "reports).", "",
                  "| language | " + " | ".join(names) + " | published (lid.176.bin) |",
                  "|---|" + "---|" * (len(names) + 1)]
        for lang in LANGS:
            lines.append(f"| {lang} | " + " | ".join(f"{li['methods'][m]['accuracy'][lang]:.3f}" for m in names)
                         + f" | {PUBLISHED[lang] / 100:.3f} |")
        lines.append("| speed, MB/s on English sections | " + " | ".join(f"{li['methods'][m]['mb_s']:.2f}" for m in names)
                     + " | |")
        lines.append("")
    if "segmenters" in r:
        sg = r["segmenters"]
        lines += ["**Word split** of Chinese and Japanese man-page paragraphs (800 each), MB/s: "
                  + "; ".join(f"{lg}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()) for lg, d in sg.items())
                  + " (ours: rjieba / SudachiPy with the surface field only; datatrove: spaCy with jieba / SudachiPy).",
                  ""]
    if "neardup" in r:
        nd = r["neardup"]
        lines += [f"**Near-dedup**, {sum(nd['docs'].values()):,} documents ("
                  + ", ".join(f"{k} {v:,}" for k, v in nd["docs"].items())
                  + f"), {nd['pairs']:,} injected pairs at known word-5-gram Jaccard, {nd['traps']:,} trap pairs "
                  "(shared boilerplate, Jaccard < 0.5). Ours: the build's stages on all documents at once; "
                  "datatrove: its four stages per language with FineWeb-2's word tokenizers.", "",
                  "| | " + " | ".join(f"ours {lg}" for lg in nd["ours_all"]) + " | datatrove zh (cmn_Hani) | "
                  "datatrove ja (jpn_Jpan) |", "|---|" + "---|" * (len(nd["ours_all"]) + 2)]
        cols = [nd["ours_all"][lg] for lg in nd["ours_all"]] + [nd["datatrove_per_language"].get(lg, {})
                                                                   for lg in ("zh", "ja")]

        def fr(x):
            return f"{x[0] / x[1]:.3f} ({x[0]}/{x[1]})" if x[1] else "-"
        for key in ("[0.50,0.75)", "[0.75,0.85)", "[0.85,1]", ">= 0.75", ">= 0.85"):
            lines.append(f"| recall J {key} | " + " | ".join(fr(c["recall"][key]) if c else "-" for c in cols) + " |")
        lines.append("| precision (closest >= 0.5) | " + " | ".join(f"{c['precision']:.4f}" if c else "-"
                                                                      for c in cols) + " |")
        lines.append("| traps merged | " + " | ".join(fr(c["traps_merged"]) if c else "-" for c in cols) + " |")
        lines += ["", "| speed (median of runs, same documents) | zh | ja |", "|---|---|---|",
                  "| MB | " + " | ".join(f"{nd['mb'][lg]:.2f}" for lg in ("zh", "ja")) + " |",
                  "| ours, s | " + " | ".join(f"{nd['seconds'][lg]['ours']:.2f}" for lg in ("zh", "ja")) + " |",
                  "| datatrove, s | " + " | ".join(f"{nd['seconds'][lg]['datatrove']:.2f}" for lg in ("zh", "ja")) + " |",
                  "| ours vs datatrove | " + " | ".join(f"**{nd['speedup'][lg]:.1f}x**" for lg in ("zh", "ja")) + " |",
                  ""]
    if "english" in r:
        e = r["english"]
        lines += [f"**English build with language ID** ({e['mb']:.1f} MB of ../shared/corpora, default filters and "
                  "dedup, one worker, so every stage runs in the benchmark's process and its CPU time is the "
                  f"build's per-core cost): off {e['off']:.1f} CPU s, on {e['on']:.1f} CPU s (medians), "
                  f"**{e['slowdown'] * 100:+.1f} %** per core (CPU s per run: off "
                  f"{', '.join(f'{x:.1f}' for x in e['runs'][False])}; on {', '.join(f'{x:.1f}' for x in e['runs'][True])}; "
                  f"wall s: off {', '.join(f'{x:.1f}' for x in e['wall'][False])}; on "
                  f"{', '.join(f'{x:.1f}' for x in e['wall'][True])}).", ""]
    if "langid_step" in r:
        ls = r["langid_step"]
        lines += [f"**Language-ID step alone** on the same English corpora ({ls['docs']:,} documents, {ls['mb']:.1f} MB; "
                  "`IdentifyLanguage.run` as the scan stage runs it, medians of alternating runs): "
                  f"{ls['cpu'][600]:.2f} CPU s reading 600 characters (the default), {ls['cpu'][1000]:.2f} reading "
                  "1000.", ""]
    history.append_section(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="filters,langid,segmenters,neardup,english")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=320, help="injected pairs per language")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    parts = args.only.split(",")
    r = {}
    if "filters" in parts:
        r["filters"] = bench_filters()
        for lang in LANGS:
            print(lang, {m: round(r["filters"][m][lang]["kept"], 3) for m in ("before", "after")}, flush=True)
    if "langid" in parts:
        r["langid"] = bench_langid()
    if "segmenters" in parts:
        r["segmenters"] = bench_segmenters()
    if "neardup" in parts:
        r["neardup"] = bench_neardup(args.runs, args.pairs)
    if "langid_step" in parts:
        r["langid_step"] = bench_langid_step(args.runs)
    if "english" in parts:
        r["english"] = bench_english(args.runs)
    print(json.dumps({k: v for k, v in r.items()}, indent=1, default=str)[:20000], flush=True)
    if not args.no_write:
        write_section(r, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
