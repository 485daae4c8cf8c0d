"""Workloads beyond raw I/O: end-to-end shard streaming (`--shards`) and checkpoint files (`--checkpoint`).

Shard streaming reads every shard of a dataset through `storage.shards.iter_shard`, the same code the
loader's verify path uses: fetch, sha256 against the manifest, tar parse, LZ4 decode, unpack to token
arrays. Threads take whole shards from a shared queue. Local shards are evicted from the page cache first.

Checkpoint files are written like a sharded checkpoint: N files of total/N bytes, one thread per file,
8 MiB buffered writes, fsync per file; then evicted and read back whole.
"""
from __future__ import annotations

import os
import threading
import time

from storage import fs
from storage.bench.io import evict, resident_fraction, run_threads
from storage.manifest import read_manifest
from storage.shards import ShardError, iter_shard

CHUNK = 8 << 20


def stream_shards(dataset: str, threads: int) -> dict:
    m = read_manifest(dataset)
    jobs = [(fs.join(dataset, sh.path), sh) for src in m.sources.values() for sh in src.shards]
    if not jobs:
        raise ValueError(f"{dataset}: manifest lists no shards")
    local = fs.is_local(dataset)
    resident = None
    if local:
        for url, _ in jobs:
            evict(fs.local_path(url))
        fr = [resident_fraction(fs.local_path(u)) for u, _ in jobs]
        resident = round(max(x or 0.0 for x in fr), 4)
    lock = threading.Lock()
    queue = list(reversed(jobs))
    counts = {"blocks": 0, "tokens": 0, "bytes": 0}

    def work(i: int, deadline: int, stop: threading.Event) -> tuple[int, list[int]]:
        lats, nbytes = [], 0
        while not stop.is_set():
            with lock:
                if not queue:
                    break
                url, sh = queue.pop()
            t = time.perf_counter_ns()
            blocks = tokens = 0
            for b in iter_shard(url, expected_sha256=sh.sha256):
                blocks += 1
                tokens += len(b.tokens)
            lats.append(time.perf_counter_ns() - t)
            if (blocks, tokens) != (sh.blocks, sh.tokens):
                raise ShardError(url, f"read {blocks} blocks / {tokens} tokens, manifest says {sh.blocks} / {sh.tokens}")
            nbytes += sh.bytes
            with lock:
                counts["blocks"] += blocks
                counts["tokens"] += tokens
                counts["bytes"] += sh.bytes
        return nbytes, lats

    _, _, secs, cpu = run_threads(min(threads, len(jobs)), work, duration=1e9)
    return {"dataset": dataset, "threads": min(threads, len(jobs)), "shards": len(jobs), "blocks": counts["blocks"],
            "tokens": counts["tokens"], "bytes": counts["bytes"], "seconds": round(secs, 6),
            "tokens_per_s": round(counts["tokens"] / secs, 1), "gib_per_s": round(counts["bytes"] / secs / 2**30, 6),
            "bytes_per_token": round(counts["bytes"] / max(1, counts["tokens"]), 4), "resident_before": resident,
            "cpu_s": round(cpu.seconds, 4),
            "steps": "fetch + sha256 + tar parse + LZ4 decode + unpack (storage.shards.iter_shard)"}


def checkpoint(kind: str, root: str, total: int, shards: int, fsys=None) -> dict:
    """Write then read `shards` files totalling `total` bytes under `root` (a local dir or fsspec path)."""
    per = -(-total // shards)
    names = [f"{root}/ckpt-{i:05d}.bin" for i in range(shards)]
    data = os.urandom(CHUNK)

    def write(i: int, deadline: int, stop: threading.Event) -> tuple[int, list[int]]:
        t, done = time.perf_counter_ns(), 0
        if kind == "local":
            with open(names[i], "wb", buffering=0) as f:
                while done < per and not stop.is_set():
                    done += f.write(data[: min(CHUNK, per - done)])
                os.fsync(f.fileno())
        else:
            with fsys.open(names[i], "wb") as f:
                while done < per and not stop.is_set():
                    n = min(CHUNK, per - done)
                    f.write(data[:n])
                    done += n
        return done, [time.perf_counter_ns() - t]

    def read(i: int, deadline: int, stop: threading.Event) -> tuple[int, list[int]]:
        t, done = time.perf_counter_ns(), 0
        if kind == "local":
            with open(names[i], "rb", buffering=0) as f:
                while not stop.is_set():
                    b = f.read(CHUNK)
                    if not b:
                        break
                    done += len(b)
        else:
            with fsys.open(names[i], "rb") as f:
                while not stop.is_set():
                    b = f.read(CHUNK)
                    if not b:
                        break
                    done += len(b)
        return done, [time.perf_counter_ns() - t]

    wbytes, _, wsecs, _ = run_threads(shards, write, duration=1e9)
    resident = None
    if kind == "local":
        for n in names:
            evict(n)
        resident = round(max(resident_fraction(n) or 0.0 for n in names), 4)
    rbytes, _, rsecs, _ = run_threads(shards, read, duration=1e9)
    for n in names:
        if kind == "local":
            os.unlink(n)
        else:
            fsys.rm_file(n)
    if rbytes != wbytes:
        raise OSError(f"{root}: checkpoint read back {rbytes} bytes, wrote {wbytes}")
    return {"total_bytes": wbytes, "files": shards, "file_bytes": per, "write_seconds": round(wsecs, 6),
            "read_seconds": round(rsecs, 6), "write_gib_per_s": round(wbytes / wsecs / 2**30, 6),
            "read_gib_per_s": round(rbytes / rsecs / 2**30, 6), "resident_before_read": resident,
            "method": "one thread per file, 8 MiB writes, fsync per file; evicted, then read back whole"}
