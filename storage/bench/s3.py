"""Object-store engine: the same tests as io.py through s3fs (or any fsspec filesystem).

Reads are ranged GETs of one I/O size each (`cat_file(start, end)`), so nothing is cached on the client;
writes are uploads through `open("wb", block_size)`, i.e. multipart parts of `block_size` bytes, each
thread writing its own object; an upload is timed until it completes. Concurrency is the thread count.
"""
from __future__ import annotations

import random
import threading
import time

import fsspec

from storage.bench.io import Point, make_point, run_threads
from storage.bench.target import BenchError, Target

MIN_PART = 5 << 20  # S3's smallest multipart part


def endpoint(url: str | None) -> None:
    """Send s3:// requests to `url` (e.g. a MinIO or moto server) - for this command and storage.fs."""
    if url:
        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = url


def open_fs(t: Target, block_size: int, concurrency: int) -> fsspec.AbstractFileSystem:
    opts: dict = {"skip_instance_cache": True}
    if t.fs_type in ("s3", "s3a"):
        if block_size < MIN_PART:
            raise BenchError(f"--s3-block-size {block_size} is below S3's 5 MiB minimum multipart part")
        opts.update(default_block_size=block_size, config_kwargs={"max_pool_connections": max(10, concurrency)})
    return fsspec.filesystem(t.fs_type, **opts)


def preflight_object(t: Target, fsys) -> None:
    """The bucket (or prefix's parent) must exist and accept a write, checked with an empty object."""
    path = t.url.split("://", 1)[1]
    bucket = path.split("/", 1)[0]
    try:
        if not fsys.exists(bucket):
            raise BenchError(f"{t.url}: bucket {bucket!r} does not exist")
        probe = f"{path}/.smoltrain-bench-probe-{random.getrandbits(32):08x}"
        fsys.pipe_file(probe, b"")
        fsys.rm_file(probe)
    except BenchError:
        raise
    except PermissionError as e:
        raise BenchError(f"{t.url}: not writable: {e}") from None
    except OSError as e:
        raise BenchError(f"{t.url}: cannot write a probe object ({type(e).__name__}: {e})") from None


class ObjectEngine:
    """Tests on one object of `file_size` bytes (and per-thread objects for writes)."""

    def __init__(self, fsys, url: str, file_size: int, block_size: int):
        self.fs, self.url, self.file_size, self.block_size = fsys, url, file_size, block_size
        self.key = url.split("://", 1)[1]
        self._data = random.randbytes(8 << 20)

    def _chunk(self, n: int) -> bytes:
        return self._data[:n] if n <= len(self._data) else random.randbytes(n)

    def prepare(self, direct: bool = False) -> None:
        with self.fs.open(self.key, "wb", block_size=self.block_size) as f:
            off = 0
            while off < self.file_size:
                n = min(len(self._data), self.file_size - off)
                f.write(self._data[:n])
                off += n

    def seq_write(self, threads: int, io_size: int, mode: str, duration: float) -> Point:
        region = max(io_size, (self.file_size // threads) // io_size * io_size)
        data = self._chunk(io_size)
        keys = [f"{self.key}.w{i}" for i in range(threads)]

        def work(i: int, deadline: int, stop: threading.Event) -> tuple[int, list[int]]:
            lats, done, clock = [], 0, time.perf_counter_ns
            with self.fs.open(keys[i], "wb", block_size=self.block_size) as f:
                while done < region and not stop.is_set():
                    t = clock()
                    f.write(data)
                    lats.append(clock() - t)
                    done += io_size
                    if t > deadline:
                        break
            return done, lats

        try:
            nbytes, lats, secs, cpu = run_threads(threads, work, duration)
        finally:
            for k in keys:
                try:
                    self.fs.rm_file(k)
                except FileNotFoundError:
                    pass
        return make_point("seq_write", mode, threads, io_size, nbytes, lats, secs, cpu=cpu)

    def _read(self, test: str, threads: int, io_size: int, mode: str, duration: float) -> Point:
        nblocks = self.file_size // io_size
        region = (self.file_size // threads) // io_size * io_size
        if nblocks == 0 or (test == "seq_read" and region == 0):
            raise ValueError(f"object of {self.file_size} bytes is too small for {threads} x {io_size} bytes")

        def work(i: int, deadline: int, stop: threading.Event) -> tuple[int, list[int]]:
            lats, clock, rng = [], time.perf_counter_ns, random.Random(i)
            off, end = i * region, (i + 1) * region
            while not stop.is_set():
                if test == "seq_read":
                    if off >= end:
                        break
                    pos, off = off, off + io_size
                else:
                    pos = rng.randrange(nblocks) * io_size
                t = clock()
                data = self.fs.cat_file(self.key, start=pos, end=pos + io_size)
                lats.append(clock() - t)
                if len(data) != io_size:
                    raise OSError(f"{self.url}: short read of {len(data)} bytes at offset {pos}")
                if t > deadline:
                    break
            return len(lats) * io_size, lats

        nbytes, lats, secs, cpu = run_threads(threads, work, duration)
        return make_point(test, mode, threads, io_size, nbytes, lats, secs, cpu=cpu)

    def seq_read(self, threads: int, io_size: int, mode: str, duration: float) -> Point:
        return self._read("seq_read", threads, io_size, mode, duration)

    def rand_read(self, threads: int, io_size: int, mode: str, duration: float) -> Point:
        return self._read("rand_read", threads, io_size, mode, duration)

    def close(self) -> None:
        pass
