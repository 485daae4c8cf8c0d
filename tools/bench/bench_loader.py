"""Streaming loader vs stock webdataset vs raw tar read + decode: tokens/s into packed batches, same run.

All paths read the same shards (one source, real BPE tokens when ../shared/corpora is present) from the
page cache, LZ4-decode every block and pack sequences of seq_len + 1 tokens (stride seq_len) into int64
batches [batch, seq_len + 1]; the peers pack as ours does (one widening copy per token, from a sliding-window
view straight into the batch):
- ours (default): `storage.loader.TokenLoader` by default: shuffled global order, a thread that plans and
  packs, blocks read, xxh3-checked and decoded by one forked decode process (`decode_processes: -1`);
- ours (N worker processes): `workers: N` (forked processes share each batch, shared-memory ring);
- ours (thread + decode threads): `decode_processes: 0` (blocks decoded by prefetch threads);
- webdataset: `wds.WebDataset(shards)` + `lz4.frame.decompress` + the same packing, in order, one core;
- webdataset in a torch DataLoader with N workers: shards split by worker (webdataset's default), workers
  decode whole blocks and hand over their uint16 tokens, the main process packs (as ours splits the work).
  Packing in the workers and handing over int64 batches as tensors, as this script did before, ran ~6x
  slower than plain webdataset: the DataLoader copies each tensor into a fresh shared-memory segment
  whose descriptor the main process fetches over a socket from the worker's resource-sharer thread, ~2 ms
  of CPU per 512 KiB batch in all processes, several times what decoding and packing it costs; the main
  process was the bottleneck, the workers waited. A block hands over 4 batches' tokens in the bytes of one;
- raw: read each shard file whole, slice members by the index, decompress, pack; one thread, in order.
Headline: one pass from creating the loader to its last batch, start-up included (ours: forking its decode
process, decoding the first shuffle window and the prefetch; a peer: opening a shard or forking workers),
per wall second and per CPU-second of the process tree (RUSAGE_SELF + RUSAGE_CHILDREN, children reaped
first). Sustained runs: the long run's sequences from a cold start, in-order peers re-reading pass after
pass. Then, ours alone: throughput and RSS per 10k sequences over a long run (flatness: each window's rate
relative to its repeat's, median over --long-runs repeats, with its standard error and the same for a
stateless raw reader as the machine's noise), and consumer wait with a simulated 50 ms training step.

    python tools/bench/bench_loader.py [--runs 5] [--long 200000] [--long-runs 41] [--append docs/benchmarks-history.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from datetime import date

import numpy as np
import torch

from storage.dataset import Dataset, SourceWriter
from storage.loader import LoaderConfig, TokenLoader
from storage.loader.bench import run_bench
from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest
from tools.bench.bench_shards import real_tokens
from tools.bench.loader_peers import (
    cycled,
    raw_batches,
    webdataset_batches,
    webdataset_dataloader_batches,
)

EVERY = 10_000  # sequences per window of the flatness runs
# Windows of the flatness runs counted as warm-up (shown, but not in the flatness figure): the first holds
# the start-up; the second is still slower in every repeat, the decode process taking more page faults
# there than in any later window.
WARMUP_WINDOWS = 2


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


def our_batches(cfg: LoaderConfig, batch: int):
    with TokenLoader(cfg, batch) as loader:
        yield from loader


def timed(batches, n_batches: int) -> tuple[float, float]:
    """(seconds to the first batch, seconds for the n_batches - 1 after it), closing the source after."""
    t0 = time.perf_counter()
    got = 0
    for _ in batches:
        got += 1
        if got == 1:
            t1 = time.perf_counter()
        if got == n_batches:
            break
    t2 = time.perf_counter()
    batches.close()
    assert got == n_batches, got
    return t1 - t0, t2 - t1


def raw_windows(shards: list[str], seq_len: int, batch: int, sequences: int, every: int) -> list[float]:
    """Control for the flatness figure: the stateless raw reader's Mtok/s per window of `every` sequences
    over the same number of sequences (repeating passes), i.e. the machine's own window-to-window noise."""
    rates, n, last_n, last_t = [], 0, 0, time.perf_counter()
    while n < sequences:
        for _ in raw_batches(shards, seq_len, batch):
            n += batch
            if n - last_n >= every:
                now = time.perf_counter()
                rates.append((n - last_n) * seq_len / (now - last_t) / 1e6)
                last_n, last_t = n, now
            if n >= sequences:
                break
    return rates


def _relative(rates: list[list[float]]) -> tuple[list[list[float]], float]:
    """(each repeat's windows divided by that repeat's steady median, i.e. the run's shape with each
    repeat's overall level, which drifts with the load on this shared machine, divided out; the median of
    those levels). Steady windows: after the warm-up (WARMUP_WINDOWS), before the last, which may be short."""
    n = min(len(r) for r in rates)
    levels = [statistics.median(r[WARMUP_WINDOWS:n - 1]) for r in rates]
    return [[x / lv for x in r[:n]] for r, lv in zip(rates, levels)], statistics.median(levels)


def largest_deviation(shape: list[float]) -> float:
    """Largest deviation (%) of a steady window of `shape` (per-window medians of _relative) from their median."""
    steady = shape[WARMUP_WINDOWS:-1]
    mid = statistics.median(steady)
    return 100 * max(abs(x - mid) for x in steady) / mid


def median_error(rel: list[list[float]]) -> float:
    """Typical standard error (%) of a steady window's median over the repeats: the median over those
    windows of 1.2533 * 1.4826 * MAD / sqrt(repeats) (normal approximation) of the relative rates."""
    errs = []
    for i in range(WARMUP_WINDOWS, len(rel[0]) - 1):
        x = [r[i] for r in rel]
        mid = statistics.median(x)
        errs.append(1.2533 * 1.4826 * statistics.median(abs(v - mid) for v in x) / len(x) ** 0.5)
    return 100 * statistics.median(errs)


def flatness(rates: list[list[float]], args) -> str:
    """The per-window shape (% from the steady median) and its largest deviation after the warm-up."""
    rel, level = _relative(rates)
    shape = [statistics.median(col) for col in zip(*rel)]
    mid = statistics.median(shape[WARMUP_WINDOWS:-1])
    pct = [f"{100 * (x / mid - 1):+.0f}" for x in shape]
    steady = [100 * (x / mid - 1) for x in shape[WARMUP_WINDOWS:-1]]
    return (f"{args.long:,} sequences, {len(rates)} repeats, median steady rate {level:.0f} Mtok/s; per window of "
            f"{EVERY:,} sequences, % from that rate (median over the repeats of each window's rate relative to "
            f"its repeat's), in order: {' '.join(pct[:WARMUP_WINDOWS])} | {' '.join(pct[WARMUP_WINDOWS:])} "
            f"(warm-up before the bar, last window short); after the warm-up min/max {min(steady):+.1f}/"
            f"{max(steady):+.1f} %, largest deviation **{largest_deviation(shape):.1f} %** (goal +-5 %; standard "
            f"error of a window's median ~{median_error(rel):.1f} %)")


def cpu_s() -> float:
    """CPU seconds of this process and of its finished children (worker processes are joined at close)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512 * 262_144)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="prefetch threads (0: the loader's auto choice)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the 'ours, N worker processes' "
                    "path and of the webdataset DataLoader path")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--long", type=int, default=200_000, help="sequences for the flatness run (0: skip)")
    ap.add_argument("--long-runs", type=int, default=41, help="repeats of the flatness run (per-window medians; "
                    "a 10k-sequence window lasts ~15-30 ms, so one repeat's windows scatter by several %%)")
    ap.add_argument("--long-cache-mib", type=int, default=128, help="max_bytes_in_flight of the long runs, MiB "
                    "(below the dataset's size, above two shuffle windows' blocks)")
    ap.add_argument("--append", help="append a results section to this markdown file")
    args = ap.parse_args()

    tokens, origin = real_tokens(args.tokens)
    tmp = tempfile.mkdtemp(prefix="bench-loader-")
    root = os.path.join(tmp, "ds")
    build(root, tokens)
    del tokens  # the loaders' worker processes are forked: a smaller parent forks faster
    gc.collect()
    ds = Dataset.open(root)
    shards = [sh.url for sh in ds.readers["bench"]]
    n_seq = (int(ds.manifest.total_tokens) - 1) // args.seq_len
    n_batches = int(n_seq * 0.95) // args.batch  # one pass; the in-order peers cannot wrap around
    cfg = LoaderConfig(dataset=root, seq_len=args.seq_len, prefetch_threads=args.threads)
    args.threads = cfg.threads()
    cfg_w = dataclasses.replace(cfg, workers=args.workers)
    cfg_t = dataclasses.replace(cfg, decode_processes=0)
    default = f"ours (default: thread + {cfg.decoders()} decode process)"
    paths = {default: lambda: our_batches(cfg, args.batch),
             f"ours ({args.workers} worker processes)": lambda: our_batches(cfg_w, args.batch),
             "ours (thread + decode threads)": lambda: our_batches(cfg_t, args.batch),
             "webdataset": lambda: webdataset_batches(shards, args.seq_len, args.batch),
             f"webdataset in a DataLoader, {args.workers} workers":
                 lambda: webdataset_dataloader_batches(shards, args.seq_len, args.batch, args.workers),
             "raw read + decode": lambda: raw_batches(shards, args.seq_len, args.batch)}
    first, rest, cpu = ({k: [] for k in paths} for _ in range(3))
    ours_d, ours_w, ours_t, peer, peer_w, raw = paths
    for _ in range(args.runs):  # interleaved, so background load hits every path alike
        for name, fn in paths.items():
            c = cpu_s()
            t1, t2 = timed(fn(), n_batches)
            first[name].append(t1)
            rest[name].append(t2)
            cpu[name].append(cpu_s() - c)
    long_batches = args.long // args.batch
    sustained_paths = {ours_d: paths[ours_d], peer: lambda: cycled(paths[peer]),
                       peer_w: lambda: webdataset_dataloader_batches(shards, args.seq_len, args.batch, args.workers,
                                                                     repeat=True),
                       raw: lambda: cycled(paths[raw])}
    sus_wall, sus_cpu = ({k: [] for k in sustained_paths} for _ in range(2))
    for _ in range(args.runs if args.long else 0):
        for name, fn in sustained_paths.items():
            c = cpu_s()
            t1, t2 = timed(fn(), long_batches)
            sus_wall[name].append(t1 + t2)
            sus_cpu[name].append(cpu_s() - c)
    tok = n_batches * args.batch * args.seq_len
    steady = {k: (tok - args.batch * args.seq_len) / statistics.median(v) for k, v in rest.items()}
    whole = {k: tok / statistics.median([a + b for a, b in zip(first[k], rest[k])]) for k in paths}
    cpu_rate = {k: tok / statistics.median(v) for k, v in cpu.items()}

    # a cache budget below the dataset's size: every epoch reads and decodes its blocks again. Each long
    # run is repeated (interleaved with the raw control) and every window's figure is its median over the
    # repeats: a burst of other load on this shared machine hits one window of one repeat, a loader that
    # slows down (or grows) with the step count shows in every repeat. The standard error of those
    # medians is reported beside them: a largest deviation near twice or three times it is what noise
    # alone gives over 17 windows.
    longs: dict[str, list[dict]] = {ours_d: [], ours_w: [], ours_t: []}
    control: list[list[float]] = []
    configs = ((ours_d, cfg), (ours_w, cfg_w), (ours_t, cfg_t))
    for _ in range(args.long_runs if args.long else 0):
        for name, c in configs:
            longs[name].append(run_bench(dataclasses.replace(c, max_bytes_in_flight=args.long_cache_mib << 20),
                                         args.batch, args.long, EVERY))
        control.append(raw_windows(shards, args.seq_len, args.batch, args.long, EVERY))
    waits = {name: run_bench(c, args.batch, 200 * args.batch, 10**9, step_s=0.05) for name, c in configs}
    shutil.rmtree(tmp)

    def vs(a: str, b: str, wall: dict, per_cpu: dict, bold: bool = False) -> str:
        r = f"{wall[a] / wall[b]:.2f}x"
        return f"{a} / {b} = {f'**{r}**' if bold else r} wall, {per_cpu[a] / per_cpu[b]:.2f}x per CPU-second"

    lines = [f"| {k} | {1e3 * statistics.median(first[k]):.1f} | {whole[k] / 1e6:.1f} | {cpu_rate[k] / 1e6:.1f} | "
             f"{steady[k] / 1e6:.1f} | {whole[ours_d] / whole[k]:.2f} | {cpu_rate[ours_d] / cpu_rate[k]:.2f} |"
             for k in paths]
    summary = [(f"- one pass, start-up included (headline): {vs(ours_d, peer, whole, cpu_rate, True)} (goal >= 2); "
                f"{vs(ours_w, peer, whole, cpu_rate)}; {vs(ours_t, peer, whole, cpu_rate)}; "
                f"{vs(ours_d, peer_w, whole, cpu_rate, True)}; {vs(ours_d, raw, whole, cpu_rate)} (goal >= 0.8)"),
               (f"- after the first batch (every path's start-up left out; for reference only): {ours_d} / webdataset "
                f"= {steady[ours_d] / steady[peer]:.2f}x, / webdataset in a DataLoader = "
                f"{steady[ours_d] / steady[peer_w]:.2f}x, / raw = {steady[ours_d] / steady[raw]:.2f}x")]
    notes = [  # what is and is not compared, one sentence per comparison
        ("ours / webdataset: the same shards from the page cache, LZ4-decoded and packed alike into the same int64 "
         "batches, timed from creating the loader to its last batch; not compared: ours also shuffles the global "
         "order, verifies an xxh3 per block and uses a second core (decode process or workers), while webdataset "
         "reads in order, unverified, on one core, which the per-CPU-second ratio accounts for."),
        (f"ours / webdataset in a DataLoader: both on two cores, webdataset's {args.workers} workers decoding whole "
         "blocks (shards split by worker) and the main process packing, as ours splits the work; not compared: "
         "shuffling and verification, which only ours does, while the DataLoader's per-block hand-over (pickled "
         "through a pipe) is a cost of that design, counted."),
        ("ours / raw read + decode: raw is the least in-order work giving the same batches (one thread, shards read "
         "whole into a reused buffer, members sliced by the index); not compared: shuffle, verification, a 2nd core."),
        ("after the first batch: leaves every start-up out, which favours ours (its start-up decodes a shuffle "
         "window ahead, a peer's is one block), so it is not a headline.")]
    if args.long:
        sus_tok = long_batches * args.batch * args.seq_len
        sw = {k: sus_tok / statistics.median(v) for k, v in sus_wall.items()}
        sc = {k: sus_tok / statistics.median(v) for k, v in sus_cpu.items()}
        summary.append(f"- sustained, {args.long:,} sequences from a cold start (start-up included), median of "
                       f"{args.runs} interleaved runs, Mtok/s wall (per CPU-second): "
                       + ", ".join(f"{k} {sw[k] / 1e6:.0f} ({sc[k] / 1e6:.0f})" for k in sw)
                       + f": {vs(ours_d, peer, sw, sc, True)} (goal >= 2); {vs(ours_d, peer_w, sw, sc)}; "
                       f"{vs(ours_d, raw, sw, sc)} (goal >= 0.8)")
        notes.append(f"sustained: {args.long:,} sequences, start-up included; the in-order peers repeat one order "
                     "(webdataset and raw restart pass after pass, the DataLoader's workers start once and cycle over "
                     "their shards), ours draws a new shuffled order per epoch.")
    notes.append("consumer wait and flatness below: ours alone, no peer; the raw reader's flatness is the machine's "
                 "noise, not a comparison.")
    summary += ["- what is and is not compared:", *(f"  - {n}" for n in notes)]
    for name in (ours_d, ours_w, ours_t):
        summary.append(f"- consumer wait with a 50 ms step, {name}: {100 * waits[name]['wait_fraction_of_step']:.2f} % "
                       "of step time over 200 steps (goal < 1 %)")
        if longs[name]:
            rates = [[r["tokens_per_s"] / 1e6 for r in run["windows"]] for run in longs[name]]
            summary.append(f"- long run, {name}, {args.long_cache_mib} MiB block budget so every epoch re-reads: "
                           + flatness(rates, args) + "; anonymous (heap) RSS per repeat "
                           + ", ".join(f"{run['rss_anon_mib_first']:.0f} → {run['rss_anon_mib_last']:.0f}"
                                       for run in longs[name])
                           + " MiB (RSS with the mapped shard pages, which are dropped every 256 MiB read: "
                           + ", ".join(f"{run['rss_mib_first']:.0f} → {run['rss_mib_last']:.0f}"
                                       for run in longs[name]) + " MiB)")
    if control:
        summary.append("- control, raw read + decode (stateless, in order) over the same sequences: "
                       + flatness(control, args) + ": the window-to-window noise of this machine")
    report = "\n".join([
        f"### Streaming loader vs webdataset vs raw read ({date.today()})", "",
        (f"Command: `python tools/bench/bench_loader.py --runs {args.runs} --long {args.long} "
        f"--long-runs {args.long_runs} --workers {args.workers}`; machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}; "
        f"data: {origin}; {len(shards)} shards, {ds.manifest.total_tokens:,} tokens; seq_len {args.seq_len}, "
        f"batch {args.batch}, {n_batches} batches per path per run (one pass), prefetch_batches "
        f"{cfg.prefetch_batches}, ours (thread + decode threads) with {args.threads} prefetch threads; files in "
        f"page cache; medians of {args.runs} interleaved runs; CPU seconds are the whole process tree's (all threads, "
        f"worker and decode processes); the peers pack as ours does (one widening copy per token); machine load "
        f"average at the start {os.getloadavg()[0]:.1f}."), "",
        ("| path | start-up (first batch) ms | **Mtok/s, one pass incl. start-up** | Mtok per CPU-second, same pass | "
         "Mtok/s after the first batch | ours (default) / path, wall | ours (default) / path, per CPU-second |"),
        "|---|---|---|---|---|---|---|", *lines, "", *summary, ""])
    print(report)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + report)


if __name__ == "__main__":
    main()
