"""Streaming loader vs stock webdataset vs raw tar read + decode: tokens/s into packed batches, same run.

All three paths read the same shards (one source, real BPE tokens when ../shared/corpora is present)
from the page cache, LZ4-decode every block and pack sequences of seq_len + 1 tokens (stride seq_len)
into int64 batches [batch, seq_len + 1]:
- ours: `storage.loader.TokenLoader` (shuffled global order, prefetch threads, checksum verified);
- webdataset: `wds.WebDataset(shards)` + `lz4.frame.decompress` + the same packing, in order;
- raw: read each shard file whole, slice members by the index, decompress, pack; one thread, in order.
Then, ours alone: throughput and RSS per 10k sequences over a long run (flatness), and consumer wait
with a simulated 50 ms training step.

    python tools/bench/bench_loader.py [--runs 5] [--long 200000] [--append docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import date

import lz4.frame
import numpy as np
import torch
import webdataset as wds

from storage.dataset import Dataset, SourceWriter
from storage.loader import LoaderConfig, TokenLoader
from storage.loader.bench import run_bench
from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest
from storage.shards import TAR_BLOCK, parse_index
from tools.bench.bench_shards import real_tokens


def build(root: str, tokens: np.ndarray) -> None:
    w = SourceWriter(root, "bench", "uint16", block_tokens=262_144, shard_blocks=16)
    ends = np.flatnonzero(tokens == 0) + 1
    start = 0
    for k, end in enumerate(ends):
        w.add_document(str(k), tokens[start:end])
        start = end
    info = w.close()
    write_manifest(root, Manifest(TokenizerInfo("bpe", "0" * 64, 32768, 0, "uint16"), {"bench": info},
                                  [Phase("all", {"bench": 1.0}, 10**12)]))


class Packer:
    """Concatenate token arrays, cut seq_len + 1 windows every seq_len tokens, emit int64 batches."""

    def __init__(self, seq_len: int, batch: int):
        self.L, self.B, self.buf, self.rows = seq_len, batch, np.empty(0, np.int64), []

    def add(self, toks: np.ndarray):
        buf = np.concatenate([self.buf, toks.astype(np.int64)])
        n = (len(buf) - 1) // self.L
        for i in range(n):
            self.rows.append(buf[i * self.L: i * self.L + self.L + 1])
            if len(self.rows) == self.B:
                yield torch.from_numpy(np.stack(self.rows))
                self.rows = []
        self.buf = buf[n * self.L:]


def peer_webdataset(shards: list[str], seq_len: int, batch: int, n_batches: int) -> int:
    p, got = Packer(seq_len, batch), 0
    for s in wds.WebDataset(shards, shardshuffle=False):
        json.loads(s["json"])
        for _ in p.add(np.frombuffer(lz4.frame.decompress(s["tokens.lz4"]), "<u2")):
            got += 1
            if got == n_batches:
                return got
    return got


def raw_read(shards: list[str], seq_len: int, batch: int, n_batches: int) -> int:
    p, got = Packer(seq_len, batch), 0
    for url in shards:
        with open(url, "rb") as f:
            data = memoryview(f.read())
        with open(url + ".idx") as f:
            index = parse_index(f.read(), url)
        for e in index:
            payload = data[e.tokens_offset + TAR_BLOCK: e.tokens_offset + TAR_BLOCK + e.tokens_size]
            for _ in p.add(np.frombuffer(lz4.frame.decompress(payload), "<u2")):
                got += 1
                if got == n_batches:
                    return got
    return got


def ours(cfg: LoaderConfig, batch: int, n_batches: int) -> int:
    with TokenLoader(cfg, batch) as loader:
        for _ in range(n_batches):
            next(loader)
    return n_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128 * 262_144)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="prefetch threads (0: the loader's auto choice)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--long", type=int, default=200_000, help="sequences for the flatness run (0: skip)")
    ap.add_argument("--long-cache-mib", type=int, default=38, help="max_bytes_in_flight of the long run, MiB")
    ap.add_argument("--append", help="append a results section to this markdown file")
    args = ap.parse_args()

    tokens, origin = real_tokens(args.tokens)
    tmp = tempfile.mkdtemp(prefix="bench-loader-")
    root = os.path.join(tmp, "ds")
    build(root, tokens)
    ds = Dataset.open(root)
    shards = [sh.url for sh in ds.readers["bench"]]
    n_seq = (int(ds.manifest.total_tokens) - 1) // args.seq_len
    n_batches = int(n_seq * 0.95) // args.batch  # one pass; the in-order peers cannot wrap around
    cfg = LoaderConfig(dataset=root, seq_len=args.seq_len, prefetch_threads=args.threads)
    args.threads = cfg.threads()
    paths = {"ours": lambda: ours(cfg, args.batch, n_batches),
             "webdataset": lambda: peer_webdataset(shards, args.seq_len, args.batch, n_batches),
             "raw": lambda: raw_read(shards, args.seq_len, args.batch, n_batches)}
    times: dict[str, list[float]] = {k: [] for k in paths}
    cpu: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(args.runs):  # interleaved, so background load hits every path alike
        for name, fn in paths.items():
            t, c = time.perf_counter(), time.process_time()
            assert fn() == n_batches, name
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    tok = n_batches * args.batch * args.seq_len
    rate = {k: tok / statistics.median(v) for k, v in times.items()}
    cpu_rate = {k: tok / statistics.median(v) for k, v in cpu.items()}

    # a cache budget below the dataset's size, so every epoch reads and decodes its blocks again
    cfg_long = dataclasses.replace(cfg, max_bytes_in_flight=args.long_cache_mib << 20)
    long = run_bench(cfg_long, args.batch, args.long, 10_000) if args.long else None
    waited = run_bench(cfg, args.batch, 200 * args.batch, 10**9, step_s=0.05)
    shutil.rmtree(tmp)

    lines = [f"| {name} | {rate[name] / 1e6:.1f} | {rate['ours'] / rate[name]:.2f} | {cpu_rate[name] / 1e6:.1f} | "
             f"{cpu_rate['ours'] / cpu_rate[name]:.2f} |" for name in paths]
    summary = (f"ours / webdataset = {rate['ours'] / rate['webdataset']:.2f}x (goal >= 2); ours / raw read + decode "
               f"= {rate['ours'] / rate['raw']:.2f}x (goal >= 0.8); consumer wait with a 50 ms step: "
               f"{100 * waited['wait_fraction_of_step']:.2f} % of step time over 200 steps (goal < 1 %)")
    if long:
        w = [r["tokens_per_s"] / 1e6 for r in long["windows"][1:-1]]
        c = [1000 * r["cpu_s_per_1k_seq"] for r in long["windows"][1:-1]]
        summary += (f"; long run ({args.long:,} sequences, {args.long_cache_mib} MiB block budget so every epoch "
                    f"re-reads): {long['tokens_per_s'] / 1e6:.1f} Mtok/s overall; per window of 10k sequences "
                    f"(first and last left out) wall throughput min/median/max {min(w):.1f}/{statistics.median(w):.1f}/"
                    f"{max(w):.1f} Mtok/s (peak-to-peak {100 * long['throughput_spread']:.0f} % of the mean, goal "
                    f"+-5 %), CPU ms per 1k sequences {min(c):.0f}/{statistics.median(c):.0f}/{max(c):.0f} "
                    f"(peak-to-peak {100 * long['cpu_per_sequence_spread']:.0f} %); RSS {long['rss_mib_first']:.0f} → "
                    f"{long['rss_mib_last']:.0f} MiB. Per window, in order: Mtok/s {' '.join(f'{x:.0f}' for x in w)}; "
                    f"CPU ms per 1k sequences {' '.join(f'{x:.0f}' for x in c)}")
    report = "\n".join([
        f"### Streaming loader vs webdataset vs raw read ({date.today()})", "",
        (f"Command: `python tools/bench/bench_loader.py --runs {args.runs} --long {args.long}`; machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}; "
        f"data: {origin}; {len(shards)} shards, {ds.manifest.total_tokens:,} tokens; seq_len {args.seq_len}, "
        f"batch {args.batch}, {n_batches} batches per path per run, ours with {args.threads} prefetch threads; "
        f"files in page cache; median of {args.runs} interleaved runs; machine load average at the start "
        f"{os.getloadavg()[0]:.1f} (other jobs share these cores, so the CPU-time column is the steadier one)."), "",
        "| path | Mtok/s into batches (wall) | ours / path | Mtok per CPU-second (all threads) | ours / path |",
        "|---|---|---|---|---|", *lines, "", summary, ""])
    print(report)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + report)


if __name__ == "__main__":
    main()
