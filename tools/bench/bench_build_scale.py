"""`datapipe build` at corpus scale: time per stage, MB/s per core, peak RSS, peak scratch, output bytes.

Builds a generated multi-file JSONL corpus (documents assembled from real sentences of ../shared/corpora,
with planted exact and near duplicates) at several sizes, FineWeb filters and both dedups on, with this
checkout and, side by side in the same run, with another git revision (`--base REV`, checked out into a
temporary worktree and run with its own code). Each build runs as `datapipe build` in a subprocess; a
sampler thread records the largest resident set of any process of the build and the bytes under the
work directory every 0.5 s.

    python tools/bench/bench_build_scale.py --sizes-mb 250,1000 --base c4b2b7d [--runs 3] [--workers 2]
        [--train-tokenizer] [--plan] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPORA = REPO.parent / "shared" / "corpora"


def sentences() -> list[str]:
    from datapipe.wordtok import tokenize_words

    out = []
    for name in ("pydoc", "shakespeare", "fortunes"):
        with gzip.open(CORPORA / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                for sent in re.split(r"(?<=[.!?])\s+", text):
                    words = sent.split()
                    # prose only, as the web text the FineWeb filters keep: no code, no verse layout
                    if not 8 <= len(words) <= 60 or any(c in sent for c in "`{}<>|=_*#"):
                        continue
                    toks = tokenize_words(sent)
                    if sum(any(c.isalpha() for c in w) for w in toks) >= 0.88 * len(toks):
                        out.append(" ".join(words))
    return out


def make_corpus(root: Path, total_mb: int, files: int, seed: int = 0) -> int:
    """`files` JSONL files of ~3 KB documents (paragraphs of random real sentences); 4 % exact copies and
    4 % near copies (a few words changed) of earlier documents. Returns the bytes written."""
    rng = random.Random(seed)
    pool = sentences()
    root.mkdir(parents=True, exist_ok=True)
    per_file = total_mb * 1_000_000 // files
    written, n = 0, 0
    recent: list[str] = []
    for k in range(files):
        with open(root / f"part-{k:04d}.jsonl", "w", encoding="utf-8") as f:
            size = 0
            while size < per_file:
                r = rng.random()
                if r < 0.04 and recent:
                    text = rng.choice(recent)
                elif r < 0.08 and recent:
                    words = rng.choice(recent).split(" ")
                    for _ in range(max(1, len(words) // 50)):
                        words[rng.randrange(len(words))] = rng.choice(("data", "model", "the", "river", "night"))
                    text = " ".join(words)
                else:
                    paras = []
                    for _ in range(rng.randint(3, 7)):  # ~3 KB, about the mean web document (FineWeb)
                        paras.append(" ".join(rng.choice(pool) for _ in range(rng.randint(4, 9))))
                    text = "\n\n".join(paras)
                    recent.append(text)
                    if len(recent) > 2000:
                        recent.pop(rng.randrange(len(recent)))
                line = json.dumps({"id": f"d{n}", "text": text}, ensure_ascii=False) + "\n"
                f.write(line)
                size += len(line.encode())
                n += 1
            written += size
    return written


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def run_build(python: str, pythonpath: str, cfg_path: Path, work: Path, workers: int) -> dict:
    import psutil

    env = {**os.environ, "PYTHONPATH": pythonpath}
    t0 = time.perf_counter()
    # cwd: `python -m` puts it first on sys.path, before PYTHONPATH and the editable install
    proc = subprocess.Popen([python, "-m", "datapipe.cli", "build", str(cfg_path), "--workers",
                             str(workers), "--quiet"], env=env, cwd=pythonpath, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    peak = {"rss": 0, "scratch": 0}
    stop = threading.Event()

    def sample():
        root = psutil.Process(proc.pid)
        while not stop.wait(0.5):
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    peak["rss"] = max(peak["rss"], p.memory_info().rss)
                except psutil.Error:
                    pass
            peak["scratch"] = max(peak["scratch"], dir_bytes(str(work)))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if proc.returncode:
        raise RuntimeError(f"build failed ({proc.returncode}):\n{out.decode()[-4000:]}")
    return {"wall_s": wall, "peak_rss": peak["rss"], "peak_scratch": peak["scratch"]}


def build_config(corpus: Path, out: Path, work: Path, workers: int, tokenizer: str | None) -> dict:
    tok = {"path": tokenizer} if tokenizer else {"vocab_size": 8192, "train_max_docs": 20000}
    return {"output": str(out), "work_dir": str(work),
            "sources": [{"name": "web", "paths": [str(corpus / "*.jsonl")]}],
            "tokenizer": tok, "executor": {"workers": workers}}


def given_tokenizer(tmp: Path) -> str:
    """An 8k BPE trained once on a sample (outside the timings): at corpus scale the tokenizer is chosen
    before the build, so the build only encodes."""
    from datapipe.tokenize import train_bpe

    pool = sentences()
    texts = [" ".join(pool[i:i + 20]) for i in range(0, min(len(pool), 200_000), 20)]
    return train_bpe(texts, 8192, "<|endoftext|>", str(tmp / "tokenizer.json"))


def measure(label: str, python: str, pythonpath: str, corpus: Path, in_bytes: int, tmp: Path, workers: int,
            tokenizer: str | None) -> dict:
    import yaml

    out, work = tmp / f"out-{label}", tmp / f"work-{label}"
    for p in (out, work):
        shutil.rmtree(p, ignore_errors=True)
    cfg_path = tmp / f"{label}.yaml"
    cfg_path.write_text(yaml.safe_dump(build_config(corpus, out, work, workers, tokenizer)))
    res = run_build(python, pythonpath, cfg_path, work, workers)
    report = json.loads((out / "build_report.json").read_text())
    out_bytes = dir_bytes(str(out)) - dir_bytes(str(out / "rejects"))
    res.update(stages=report["elapsed_s"], out_bytes=out_bytes, in_bytes=in_bytes,
               mb_s_core=in_bytes / 1e6 / res["wall_s"] / workers,
               tokens=json.loads((out / "manifest.json").read_text())["build_stats"].get("tokens"))
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return res


def predict(corpus: Path, tmp: Path, workers: int, tokenizer: str | None, sample_mb: float) -> dict:
    """`datapipe plan` (this checkout) for the same build on 1 node x `workers` CPUs."""
    from datapipe.config import BuildConfig
    from datapipe.plan import make_plan
    from storage import config as cfgmod

    cfg = cfgmod.from_dict(BuildConfig, build_config(corpus, tmp / "plan-out", tmp / "plan-work", workers, tokenizer))
    p = make_plan(cfg, nodes=1, cpus_per_node=workers, sample_mb=sample_mb, tmp=str(tmp))
    return {"wall_s": p.wall_s, "scratch": p.scratch_bytes, "out_bytes": p.output_bytes, "sample_mb": sample_mb}


def base_checkout(rev: str, tmp: Path) -> Path:
    path = tmp / f"base-{rev}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                   capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", default="250,1000")
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--base", default=None, help="git revision to measure side by side (today's code)")
    ap.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--train-tokenizer", action="store_true",
                    help="train the BPE inside each build (default: a given tokenizer.json, trained beforehand)")
    ap.add_argument("--runs", type=int, default=1, help="builds per size and code (medians reported)")
    ap.add_argument("--plan", action="store_true", help="also run `datapipe plan` first and compare")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="bench-scale-"))
    tmp.mkdir(parents=True, exist_ok=True)
    base = base_checkout(args.base, tmp) if args.base else None
    tokenizer = None if args.train_tokenizer else given_tokenizer(tmp)
    rows = []
    try:
        for mb in [int(x) for x in args.sizes_mb.split(",")]:
            corpus = tmp / f"corpus-{mb}"
            shutil.rmtree(corpus, ignore_errors=True)
            in_bytes = make_corpus(corpus, mb, args.files)
            plan = predict(corpus, tmp, args.workers, tokenizer, min(16.0, mb / 4)) if args.plan else None
            print("plan:", json.dumps(plan), flush=True)
            codes = [("this", str(REPO))] + ([(f"base {args.base}", str(base))] if base else [])
            results: dict[str, list[dict]] = {label: [] for label, _ in codes}
            for k in range(args.runs):  # alternate the codes, so drifting load hits both alike
                for label, path in codes:
                    print(f"[{mb} MB] {label} run {k + 1} ...", flush=True)
                    res = measure(label.split()[0], sys.executable, path, corpus, in_bytes, tmp, args.workers,
                                  tokenizer)
                    print(json.dumps(res), flush=True)
                    results[label].append(res)
            for label, runs in results.items():
                res = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # the median run
                res.update(size_mb=mb, code=label, runs=len(runs), plan=plan if label == "this" else None)
                rows.append(res)
            shutil.rmtree(corpus, ignore_errors=True)
    finally:
        if base:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
    if not args.no_write:
        write_section(rows, args)


def write_section(rows: list[dict], args) -> None:
    cmd = " ".join(["python tools/bench/bench_build_scale.py", *sys.argv[1:]])
    lines = [f"\n## datapipe build at scale ({datetime.date.today()})\n", f"Command: `{cmd}`  ",
             f"Machine: {os.cpu_count()} cores, {platform.platform()}; {args.files} input files, "
             f"{args.workers} workers, FineWeb filters, exact + MinHash dedup, "
             + ("BPE 8k trained in the build on 20k docs" if args.train_tokenizer else "a given 8k BPE")
             + f"; median of {args.runs} run(s) per row.\n",
             "| size | code | wall s | MB/s per core | peak RSS (largest process) MB | peak scratch / input | "
             "output / input | stages (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = ", ".join(f"{k} {v:.1f}" for k, v in r["stages"].items())
        lines.append(f"| {r['size_mb']} MB | {r['code']} | {r['wall_s']:.1f} | {r['mb_s_core']:.2f} | "
                     f"{r['peak_rss'] / 2**20:.0f} | {r['peak_scratch'] / r['in_bytes']:.2f} | "
                     f"{r['out_bytes'] / r['in_bytes']:.2f} | {st} |")
    plans = [r for r in rows if r.get("plan")]
    if plans:
        lines += ["", "`datapipe plan` (same config, 1 node x workers CPUs, built on a sample) against the build:", "",
                  "| size | sample | predicted wall s | actual wall s | predicted / actual scratch | "
                  "predicted / actual output |", "|---|---|---|---|---|---|"]
        for r in plans:
            p = r["plan"]
            lines.append(f"| {r['size_mb']} MB | {p['sample_mb']:.0f} MB | {p['wall_s']:.0f} | {r['wall_s']:.0f} | "
                         f"{p['scratch'] / max(1, r['peak_scratch']):.2f} | {p['out_bytes'] / r['out_bytes']:.2f} |")
    with open(REPO / "docs" / "benchmarks-history.md", "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
