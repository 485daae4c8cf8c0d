"""Benchmark datapipe's fast paths against their peers, in one process, on ../shared/corpora.

1. Filter chain (FineWeb's: Gopher repetition + quality, C4, FineWeb) with our FastWordTokenizer vs the same
   datatrove filters on spaCy: docs/s, and the agreement of keep decisions on every corpus document.
2. MinHash signatures (5-grams, the default bands x rows): our FastMinhashSignature vs datatrove's
   MinhashDedupSignature vs datasketch `MinHash.bulk` (same shingles and number of permutations): docs/s
   on one core, and for how many documents the signature files of a whole run of each step (same input)
   hold identical records.
3. Tokenization: the build's tokenize stage (TokenizeStep: batch encode + EOS + packing into LZ4 shards)
   vs bare `tokenizers` batch encode of the same texts.

Speeds are medians of --runs alternating runs on a fixed subset, our tokenizer's memo cleared before each;
the agreement uses all documents unless --limit.
Appends a section to docs/benchmarks-history.md unless --no-write.

    python tools/bench/bench_dedup.py [--runs 3] [--limit N] [--no-write] [--only filters|signatures|tokenize]
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import history  # the script's folder is on sys.path

REPO = Path(__file__).resolve().parents[2]
CORPORA = REPO.parent / "shared" / "corpora"
NAMES = ("fortunes", "pydoc", "shakespeare", "licenses")


def load(limit_per: dict[str, int] | None = None) -> list[str]:
    texts = []
    for name in NAMES:
        with gzip.open(CORPORA / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if limit_per and i >= limit_per.get(name, 0):
                    break
                texts.append(json.loads(line)["text"])
    return texts


def chain(language):
    """FineWeb's chain exactly as `datapipe build` assembles it (fast path) or as datatrove ships it."""
    from datapipe.config import fineweb_filters
    from datapipe.filters import _CLASSES, build_filter

    if isinstance(language, str):
        return [_CLASSES[spec.type](language=language, **spec.params) for spec in fineweb_filters()]
    return [build_filter(spec, language) for spec in fineweb_filters()]


def decide(filters, text: str) -> str:
    """'keep' or the label of the first filter that drops the document."""
    from datatrove.data import Document

    doc = Document(text=text, id="x")
    for f in filters:
        r = f.filter(doc)
        ok = r[0] if isinstance(r, tuple) else r
        if not ok:
            return f"{f.name}:{r[1] if isinstance(r, tuple) else ''}"
    return "keep"


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_pair(fa, fb, runs: int) -> tuple[float, float]:
    """Medians of alternating runs of fa and fb, so load from other processes hits both alike."""
    ta, tb = [], []
    for _ in range(runs):
        ta.append(timed(fa, 1))
        tb.append(timed(fb, 1))
    return statistics.median(ta), statistics.median(tb)


def cold() -> None:
    """Forget our tokenizer's memos, so every timed run starts as a fresh process would."""
    from datapipe import wordtok
    from datapipe.dedup import minhash

    wordtok._CHUNKS.clear()
    minhash._WORDS.clear()
    minhash._SPLIT.clear()


def bench_filters(subset: list[str], full: list[str], runs: int) -> dict:
    from datapipe.wordtok import FastWordTokenizer

    slow = chain("en")

    def run_fast():
        cold()
        fast = chain(FastWordTokenizer())
        return [decide(fast, t) for t in subset]

    t_fast, t_slow = timed_pair(run_fast, lambda: [decide(slow, t) for t in subset], runs)
    fast = chain(FastWordTokenizer())
    agree = 0
    disagreements: dict[str, int] = {}
    kept_fast = kept_slow = 0
    for t in full:
        a, b = decide(fast, t), decide(slow, t)
        kept_fast += a == "keep"
        kept_slow += b == "keep"
        if (a == "keep") == (b == "keep"):
            agree += 1
        else:
            key = f"ours={a} spacy={b}"
            disagreements[key] = disagreements.get(key, 0) + 1
    return {"docs": len(subset), "fast_docs_s": len(subset) / t_fast, "spacy_docs_s": len(subset) / t_slow,
            "speedup": t_slow / t_fast, "agreement_docs": len(full), "agreement": agree / len(full),
            "kept_fast": kept_fast, "kept_spacy": kept_slow,
            "top_disagreements": sorted(disagreements.items(), key=lambda kv: -kv[1])[:5]}


def bench_signatures(texts: list[str], runs: int) -> dict:
    from datasketch import MinHash
    from datatrove.pipeline.dedup.minhash import MinhashDedupSignature
    from datatrove.utils.text import simplify_text

    from datapipe.config import MinhashSettings
    from datapipe.dedup.minhash import FastMinhashSignature, minhash_config
    from datapipe.wordtok import tokenize_words

    cfg = minhash_config(MinhashSettings())
    ours = FastMinhashSignature("/tmp/bench-unused", config=cfg)
    ref = MinhashDedupSignature("/tmp/bench-unused", config=cfg, language="en")

    def sigs(step):
        out = []
        sign = step.minhashes if isinstance(step, FastMinhashSignature) else step.get_signature
        for t in texts:
            sh = step.get_shingles(t)
            out.append(sign(sh) if sh.size else None)
        return out

    def shingles_bytes(t):
        w = tokenize_words(simplify_text(t))
        return [" ".join(w[i:i + 5]).encode() for i in range(len(w) - 4)]

    def sketch():
        batch = [s for s in (shingles_bytes(t) for t in texts) if s]
        return MinHash.bulk(batch, num_perm=cfg.num_buckets * cfg.hashes_per_bucket)

    t_ours, t_ref = timed_pair(lambda: (cold(), sigs(ours)), lambda: sigs(ref), runs)
    t_ds = timed(sketch, runs)
    return {"docs": len(texts), "ours_docs_s": len(texts) / t_ours, "datatrove_docs_s": len(texts) / t_ref,
            "datasketch_docs_s": len(texts) / t_ds, "vs_datatrove": t_ref / t_ours, "vs_datasketch": t_ds / t_ours,
            "identical_signatures": signature_file_agreement(texts, cfg)}


def signature_file_agreement(texts: list[str], cfg) -> float:
    """Whole runs of our FastMinhashSignature and datatrove's MinhashDedupSignature (spaCy) on the same
    documents, each writing its signature files; the fraction of documents whose records (every bucket,
    read back with datatrove's reader) are identical. A document without a 5-gram has no record in
    either run and counts as identical only if both agree on that."""
    import tempfile

    from datatrove.data import Document
    from datatrove.io import get_datafolder
    from datatrove.pipeline.dedup.minhash import MinhashDedupSignature, read_sigs

    from datapipe.dedup.minhash import FastMinhashSignature

    def records(folder: str) -> dict[int, list[tuple]]:
        df, out = get_datafolder(folder), {}
        for bi in range(cfg.num_buckets):
            for hs in read_sigs(df.open(f"bucket_{bi:03d}/00000.minhash.sig", "rb"), 0, cfg):
                out.setdefault(hs.doc_id, []).append(hs.sig)
        return out

    with tempfile.TemporaryDirectory(prefix="bench-dedup-sigs-") as tmp:
        for step in (FastMinhashSignature(f"{tmp}/ours", config=cfg),
                     MinhashDedupSignature(f"{tmp}/ref", config=cfg, language="en")):
            step.run(iter([Document(text=t, id=str(i)) for i, t in enumerate(texts)]), rank=0, world_size=1)
        a, b = records(f"{tmp}/ours"), records(f"{tmp}/ref")
    return sum(a.get(i) == b.get(i) for i in range(len(texts))) / len(texts)


def bench_tokenize(texts: list[str], tokenizer_path: str, runs: int) -> dict:
    """The build's tokenize stage (TokenizeStep: batch encode, EOS, packing into LZ4 shards, the held-out
    candidates) against bare `encode_batch_fast` of the same texts in the same batches."""
    import shutil
    import tempfile

    from datatrove.data import Document
    from tokenizers import Tokenizer

    from datapipe.config import ValidationConfig
    from datapipe.shardout import ShardOut
    from datapipe.tokenize import TokenizeStep

    tok = Tokenizer.from_file(tokenizer_path)
    docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts)]
    tmp = tempfile.mkdtemp(prefix="bench-tokenize-")
    out = ShardOut(os.path.join(tmp, "ds"), os.path.join(tmp, "work"), tokenizer_path, 262_144, 64,
                   ValidationConfig(), {"bench": None})
    step = TokenizeStep(tokenizer_path, "<|endoftext|>", out, ["bench"], batch_size=256)

    def ours():
        for _ in step.run(iter(docs), rank=0):
            pass

    def bare():
        n = 0
        for i in range(0, len(texts), 256):
            n += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + 256], add_special_tokens=False))
        return n

    n_tokens = bare()
    ours()  # both tokenizers warm (a real task encodes many batches)
    try:
        t_ours, t_bare = timed_pair(ours, bare, runs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tokens": n_tokens, "ours_tok_s": n_tokens / t_ours, "bare_tok_s": n_tokens / t_bare,
            "ratio": t_bare / t_ours}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit", type=int, default=None, help="documents per corpus for the agreement (default all)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--only", choices=["filters", "signatures", "tokenize"], default=None,
                    help="run one part (its row is printed, nothing is written)")
    args = ap.parse_args()
    if not CORPORA.exists():
        print(f"corpora not found at {CORPORA}", file=sys.stderr)
        return 2
    subset = load({"fortunes": 2000, "pydoc": 250, "shakespeare": 80, "licenses": 14})
    f = s = k = None
    if args.only in (None, "filters"):
        full = load({n: args.limit for n in NAMES}) if args.limit else load()
        print(f"filter chain: {len(subset)} docs for speed, {len(full)} for agreement ...", flush=True)
        f = bench_filters(subset, full, args.runs)
        print(json.dumps(f, indent=1), flush=True)
    if args.only in (None, "signatures"):
        print("signatures ...", flush=True)
        s = bench_signatures(subset, args.runs)
        print(json.dumps(s, indent=1), flush=True)
    if args.only in (None, "tokenize"):
        print("tokenize ...", flush=True)
        from datapipe.tokenize import train_bpe

        tok_path = train_bpe(subset, 8192, "<|endoftext|>", "/tmp/bench-dedup-tokenizer.json")
        k = bench_tokenize(load({"pydoc": 1000, "shakespeare": 300}), tok_path, args.runs)
        print(json.dumps(k, indent=1), flush=True)
        print(f"tokenize stage / bare tokenizers: {k['ratio']:.3f}x (goal >= 0.9x)", flush=True)
    if not args.no_write:
        write_section(f, s, k, args)
    return 0


def write_section(f: dict, s: dict, k: dict, args) -> None:
    cpu = platform.processor() or platform.machine()
    lines = [
        "", f"## datapipe: filters, MinHash signatures, tokenization ({datetime.date.today().isoformat()})", "",
        f"Command: `python tools/bench/bench_dedup.py --runs {args.runs}" + (f" --limit {args.limit}" if args.limit
                                                                              else "")
        + (f" --only {args.only}" if args.only else "") + "`  ",
        (f"Machine: {os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, one process (per-core "
         "figures; other jobs shared the machine). Medians of alternating runs (our memo cleared each run); corpora ../shared/corpora."), "",
        "| what | ours | peer | ratio | goal |", "|---|---|---|---|---|"]
    if f is not None:
        lines += [
            (f"| filter chain (FineWeb rules), docs/s on {f['docs']:,} docs | {f['fast_docs_s']:,.0f} | "
             f"{f['spacy_docs_s']:,.0f} (datatrove + spaCy) | {f['speedup']:.1f}x | >= 5x |"),
            (f"| keep-decision agreement with datatrove's spaCy chain, {f['agreement_docs']:,} docs | "
             f"{100 * f['agreement']:.2f} % | kept {f['kept_fast']:,} vs {f['kept_spacy']:,} | | >= 99 % |")]
    if s is not None:
        lines += [
            (f"| MinHash signatures docs/s ({s['docs']:,} docs) | {s['ours_docs_s']:,.0f} | "
             f"{s['datatrove_docs_s']:,.0f} (datatrove) | {s['vs_datatrove']:.1f}x | >= 3x |"),
            (f"| same, vs datasketch `MinHash.bulk` | {s['ours_docs_s']:,.0f} | {s['datasketch_docs_s']:,.0f} | "
             f"{s['vs_datasketch']:.1f}x | |"),
            (f"| documents whose signature-file records equal datatrove's (whole runs of both steps) | "
             f"{100 * s['identical_signatures']:.2f} % | | | |")]
    if k is not None:
        lines.append(f"| tokenize stage (TokenizeStep: encode, EOS, LZ4 shards, held-out candidates), tokens/s "
                     f"({k['tokens']:,} tokens) | {k['ours_tok_s']:,.0f} | {k['bare_tok_s']:,.0f} (bare "
                     f"`encode_batch_fast`) | {k['ratio']:.2f}x | >= 0.9x |")
    lines.append("")
    if f is not None and f["top_disagreements"]:
        lines.append("Most frequent filter disagreements: "
                     + "; ".join(f"{k} ({v})" for k, v in f["top_disagreements"]))
        lines.append("")
    history.append_section(lines)


if __name__ == "__main__":
    sys.exit(main())
