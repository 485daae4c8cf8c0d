"""The `storage bench` click command: validate every target, sweep, write table + JSON + PNGs, clean up."""
from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
from dataclasses import dataclass

import click

from storage.bench import fio, gds, plots, report, s3, workloads
from storage.bench.io import LocalEngine, probe_direct
from storage.bench.target import BenchError, Scratch, Target, preflight_local, resolve, sigterm_as_interrupt
from storage.bench.units import fmt_size, parse_list, parse_size
from storage.bench.verdict import tier_verdict

TESTS = ("seq_write", "seq_read", "rand_read")
CPU_BOUND_BUSY = 0.5  # below this share of thread time in I/O calls, a point is flagged as CPU-bound
CPU_WAIT_MAX = 0.2  # above this share of thread time waiting for a CPU (a loaded machine), likewise
QUICK = {"threads": "1,4", "sizes": "64K,1M", "rand_sizes": "4K", "file_size": "16M", "duration": 0.2}
FULL = {"threads": "1,2,4,8,16,32,64", "sizes": "64K,256K,1M,4M,8M", "rand_sizes": "4K,64K", "file_size": "1G",
        "duration": 2.0}


@dataclass
class Settings:
    threads: list[int]
    sizes: list[int]
    rand_sizes: list[int]
    modes: list[str]
    tests: list[str]
    file_size: int
    duration: float
    checkpoint: int | None
    checkpoint_files: int
    s3_block_size: int
    vs_fio: bool
    quick: bool


def _settings(quick, threads, sizes, rand_sizes, modes, tests, file_size, duration, checkpoint, checkpoint_files,
              s3_block_size, vs_fio) -> Settings:
    d = QUICK if quick else FULL
    st = Settings(parse_list(threads or d["threads"], int), parse_list(sizes or d["sizes"]),
                  parse_list(rand_sizes or d["rand_sizes"]), [m.strip() for m in modes.split(",") if m.strip()],
                  [x.strip() for x in tests.split(",") if x.strip()], parse_size(file_size or d["file_size"]),
                  float(duration if duration is not None else d["duration"]),
                  parse_size(checkpoint) if checkpoint else None, checkpoint_files, parse_size(s3_block_size),
                  vs_fio, quick)
    for m in st.modes:
        if m not in ("buffered", "direct"):
            raise ValueError(f"--modes: unknown mode {m!r} (buffered, direct)")
    for x in st.tests:
        if x not in TESTS:
            raise ValueError(f"--tests: unknown test {x!r} ({', '.join(TESTS)})")
    for s in st.sizes + st.rand_sizes:
        if s % 4096:
            raise ValueError(f"I/O size {s} is not a multiple of 4 KiB (O_DIRECT needs aligned I/O)")
    if min(st.threads) < 1 or st.duration <= 0 or st.checkpoint_files < 1:
        raise ValueError("--threads, --duration and --checkpoint-files must be positive")
    biggest = max(st.sizes + st.rand_sizes)
    st.file_size = -(-st.file_size // biggest) * biggest
    seq = {"seq_write", "seq_read"} & set(st.tests)
    if seq and st.file_size < max(st.threads) * max(st.sizes):
        raise ValueError(f"--file-size {fmt_size(st.file_size)} is smaller than max threads x max I/O size "
                         f"({max(st.threads)} x {fmt_size(max(st.sizes))}); raise it or lower --threads/--sizes")
    return st


def _progress(t: Target, p) -> None:
    click.echo(f"  {t.url}: {p.test} {p.mode} {p.threads}thr {fmt_size(p.io_size)}: {p.gib_per_s:.3f} GiB/s "
               f"{p.iops:,.0f} IOPS p99 {p.lat_p99_us:.0f} us", err=True)


def _fio_compare(engine: LocalEngine, st: Settings, mode: str) -> list[dict]:
    """Our point and fio's on the same file, back to back: seq read 1 MiB x 1 thread, rand read 4 KiB x <=32."""
    out = []
    secs = float(max(1, round(st.duration)))  # fio takes whole seconds
    for test, size, thr in (("seq_read", 1 << 20, 1), ("rand_read", 4096, min(32, max(st.threads)))):
        ours = getattr(engine, test)(thr, size, mode, secs).to_dict()
        theirs = fio.run(engine.path, engine.file_size, test, mode, thr, size, secs)
        out.append({"test": test, "mode": mode, "threads": thr, "io_size": size, "ours": ours, "fio": theirs,
                    "ratio": round(ours["gib_per_s"] / theirs["gib_per_s"], 4) if theirs["gib_per_s"] else None})
    return out


def run_target(t: Target, fsys, st: Settings, scratches: list[Scratch]) -> dict:
    scratch = Scratch(t, fsys)
    scratches.append(scratch)
    scratch.create()
    res: dict = {"target": t.url, "kind": t.kind, "fs_type": t.fs_type, "mount": t.mount, "volatile": t.volatile,
                 "file_size": st.file_size, "checkpoint": None, "fio": None, "fio_note": None}
    if t.kind == "local":
        ok, why = probe_direct(scratch.root, t.fs_type)
        res["direct"] = {"supported": ok, "requested": "direct" in st.modes, "reason": why}
        modes = [m for m in st.modes if m != "direct" or ok] or ["buffered"]
        engine = LocalEngine(scratch.file("data.bin"), st.file_size)
        engine.prepare(ok)
    else:
        res["direct"] = {"supported": False, "requested": "direct" in st.modes,
                         "reason": "object store: no O_DIRECT; every read is a ranged GET, never cached on the client"}
        modes = ["s3fs"]
        engine = s3.ObjectEngine(fsys, scratch.file("data.bin"), st.file_size, st.s3_block_size)
        engine.prepare()
    points = []
    for mode in modes:
        for thr in st.threads:
            for size in st.sizes:
                for test in ("seq_write", "seq_read"):
                    if test in st.tests:
                        points.append(getattr(engine, test)(thr, size, mode, st.duration))
                        _progress(t, points[-1])
        if "rand_read" in st.tests:
            for thr in st.threads:
                for size in st.rand_sizes:
                    points.append(engine.rand_read(thr, size, mode, st.duration))
                    _progress(t, points[-1])
    res["results"] = [p.to_dict() for p in points]
    slow = [f"{p.test} {p.mode} {p.threads}thr {fmt_size(p.io_size)}" for p in points
            if p.io_busy < CPU_BOUND_BUSY or p.cpu_wait > CPU_WAIT_MAX]
    res["cpu_bound"] = {"io_busy_min": CPU_BOUND_BUSY, "cpu_wait_max": CPU_WAIT_MAX, "points": slow, "note": (
        f"{len(slow)} of {len(points)} points spent < {100 * CPU_BOUND_BUSY:.0f}% of thread time inside I/O calls or "
        f"> {100 * CPU_WAIT_MAX:.0f}% waiting for a CPU: they measure this process's CPU (Python, GIL, machine load) "
        "as much as the storage, so read them as lower bounds" if slow else "none")}

    ok, why = gds.probe(t.fs_type, t.kind)
    res["gds"] = {"available": ok, "reason": why, "results": []}
    if ok:
        res["gds"]["results"] = gds.gds_read(engine.path, st.file_size, st.sizes, st.duration)

    reads = [p.resident_before for p in points if p.resident_before is not None and p.mode == "buffered"]
    worst = max(reads) if reads else None
    if t.kind == "object":
        note = "not applicable: ranged GETs bypass any client cache"
    elif t.volatile:
        note = (f"{t.fs_type} holds file data in memory, eviction is impossible: reads are memory speed "
                f"(residency up to {100 * (worst or 0):.0f}%)")
    elif worst is not None and worst > 0.05:
        note = (f"WARNING: up to {100 * worst:.0f}% of the file was still cached when a read started; read figures "
                "may include page-cache hits")
    else:
        note = (f"evicted with posix_fadvise(DONTNEED) before each read; mincore residency at most "
                f"{100 * (worst or 0):.0f}%")
    res["page_cache"] = {"method": "posix_fadvise(DONTNEED) + mincore" if t.kind == "local" else None,
                         "max_resident_before": worst, "note": note}

    if st.vs_fio:
        avail, why = fio.available()
        if t.kind != "local":
            res["fio_note"] = "fio comparison runs on local files only"
        elif not avail:
            res["fio_note"] = why
        else:
            res["fio"] = _fio_compare(engine, st, "direct" if "direct" in modes else "buffered")
            for f in res["fio"]:
                click.echo(f"  {t.url}: vs fio {f['test']}: ratio {f['ratio']}", err=True)
    if st.checkpoint:
        root = scratch.root if t.kind == "local" else scratch.root.split("://", 1)[1]
        res["checkpoint"] = workloads.checkpoint(t.kind, root, st.checkpoint, st.checkpoint_files, fsys)
    engine.close()
    scratch.remove()
    res["summary"] = report.summarize(res["results"])
    return res


@click.command("bench")
@click.argument("targets", nargs=-1, required=True, metavar="PATH|URL...")
@click.option("--quick", is_flag=True, help="Small CI run: threads 1,4; sizes 64K,1M; 4K random; 16 MiB file; 0.2 s.")
@click.option("--threads", help="Thread counts to sweep (default 1,2,4,8,16,32,64).")
@click.option("--sizes", help="Sequential I/O sizes (default 64K,256K,1M,4M,8M).")
@click.option("--rand-sizes", help="Random-read I/O sizes (default 4K,64K).")
@click.option("--modes", default="buffered,direct", show_default=True, help="buffered and/or direct (O_DIRECT).")
@click.option("--tests", default=",".join(TESTS), show_default=True, help="Subset of tests to run.")
@click.option("--file-size", help="Test file size per target (default 1G; rounded up to the largest I/O size).")
@click.option("--duration", type=float, help="Seconds per test point at most (default 2).")
@click.option("--shards", "shards", metavar="DATASET", help="Also stream every shard of DATASET: tokens/s.")
@click.option("--shard-threads", default=4, show_default=True, help="Threads for --shards.")
@click.option("--checkpoint", metavar="SIZE", help="Also write+read checkpoint-like files of SIZE in total.")
@click.option("--checkpoint-files", default=8, show_default=True, help="Number of files for --checkpoint.")
@click.option("--vs-fio", is_flag=True, help="Run fio's equivalent jobs on the same file, print both.")
@click.option("--need-tokens-per-s", type=float, help="Token rate the run needs, for the verdict.")
@click.option("--s3-block-size", default="8M", show_default=True, help="s3fs block (multipart part) size.")
@click.option("--endpoint-url", help="S3 endpoint (MinIO, moto, ...) for s3:// targets and datasets.")
@click.option("--out", "out_dir", default="storage-bench", show_default=True, help="Folder for bench.json and PNGs.")
def bench(targets, quick, threads, sizes, rand_sizes, modes, tests, file_size, duration, shards, shard_threads,
          checkpoint, checkpoint_files, vs_fio, need_tokens_per_s, s3_block_size, endpoint_url, out_dir) -> None:
    """Measure sequential write/read throughput, random-read IOPS and latency of each PATH|URL.

    Sweeps threads x I/O size, buffered and O_DIRECT, avoiding the page cache; optionally streams a
    dataset's shards and writes checkpoint-like files; prints a table and a verdict per tier, and writes
    OUT/bench.json and PNG plots. Test files live in a `.smoltrain-bench-*` folder that is always removed."""
    sigterm_as_interrupt()
    try:
        st = _settings(quick, threads, sizes, rand_sizes, modes, tests, file_size, duration, checkpoint,
                       checkpoint_files, s3_block_size, vs_fio)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    s3.endpoint(endpoint_url)
    prepared = []
    try:  # every check before any test I/O
        for url in targets:
            t = resolve(url)
            if t.kind == "local":
                preflight_local(t, st.file_size + (st.checkpoint or 0) + (8 << 20))
                prepared.append((t, None))
            else:
                fsys = s3.open_fs(t, st.s3_block_size, max(st.threads + [st.checkpoint_files]))
                s3.preflight_object(t, fsys)
                prepared.append((t, fsys))
        if shards:
            from storage.manifest import read_manifest
            read_manifest(shards)
    except (BenchError, FileNotFoundError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)

    scratches: list[Scratch] = []
    try:
        rep = {"version": 1, "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "host": {"hostname": socket.gethostname(), "kernel": platform.release(), "cpus": os.cpu_count(),
                        "python": platform.python_version()},
               "settings": {k: v for k, v in vars(st).items()} | {"need_tokens_per_s": need_tokens_per_s},
               "targets": [], "shards": None, "plots": []}
        for t, fsys in prepared:
            rep["targets"].append(run_target(t, fsys, st, scratches))
        if shards:
            rep["shards"] = workloads.stream_shards(shards, shard_threads)
        bpt = rep["shards"]["bytes_per_token"] if rep["shards"] else None
        for t in rep["targets"]:
            t["verdict"] = tier_verdict(t, need_tokens_per_s, bpt, st.checkpoint, rep["shards"])
        os.makedirs(out_dir, exist_ok=True)
        for t in rep["targets"]:
            rep["plots"] += plots.plot_target(t, out_dir)
        path = report.write_json(rep, out_dir)
        click.echo(report.table(rep))
        click.echo(f"\nwrote {path} and {len(rep['plots'])} plots in {out_dir}")
    except KeyboardInterrupt:
        for s in scratches:
            s.remove()
        click.echo(f"\ninterrupted: removed test files ({', '.join(s.root for s in scratches) or 'none yet'})",
                   err=True)
        sys.exit(130)
    finally:
        for s in scratches:
            s.remove()
