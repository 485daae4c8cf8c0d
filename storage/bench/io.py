"""Local raw I/O: a thread runner with per-op latencies, and sequential/random tests on one file.

Each test point runs T threads for at most `duration` seconds. Sequential tests give each thread its
own contiguous region (file_size / T) and walk it once in I/O-size steps (like fio with `size` and
`runtime` but no `time_based`); random reads pick aligned offsets over the whole file until the
deadline. Writes are timed up to and including fsync. Before every read point the file is evicted
from the page cache with posix_fadvise(DONTNEED) and its residency is measured with mincore(2), so a
report can show whether the page cache was (accidentally) measured.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import pickle
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

PAGE = mmap.PAGESIZE
ALIGN = 4096
BATCH = 32  # I/Os between deadline checks


@dataclass
class Point:
    """One measured point of the sweep."""
    test: str          # seq_write | seq_read | rand_read
    mode: str          # buffered | direct | s3fs
    threads: int
    io_size: int
    bytes: int
    ops: int
    seconds: float
    gib_per_s: float
    iops: float
    lat_p50_us: float
    lat_p99_us: float
    resident_before: float | None  # fraction of the file in the page cache when a read point started
    resident_after: float | None = None  # ... and when it ended (buffered reads fill the cache as they go)
    io_busy: float = 0.0  # share of thread-time spent inside I/O calls; low = CPU/GIL-bound, not storage-bound
    cpu_s: float = 0.0    # process CPU seconds (user + system) during the point
    cpu_wait: float = 0.0  # share of thread time spent runnable but waiting for a CPU (schedstat): machine load

    def to_dict(self) -> dict:
        return asdict(self)


Work = Callable[[int, int, threading.Event], tuple[int, list[int]]]


class CpuUse(NamedTuple):
    seconds: float  # process CPU (user + system)
    wait: float     # share of thread time spent runnable but not running


def run_threads(n: int, work: Work, duration: float) -> tuple[int, list[int], float, CpuUse]:
    """Run work(thread_id, deadline_ns, stop) in n threads; return (bytes, latencies_ns, seconds, CpuUse).

    Ctrl-C in the main thread stops the workers at their next operation and re-raises."""
    stop = threading.Event()
    out: list[tuple[int, list[int]] | None] = [None] * n
    errors: list[BaseException] = []
    waits = [0] * n

    def body(i: int) -> None:
        w0 = _runqueue_wait_ns()
        try:
            out[i] = work(i, deadline, stop)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
            stop.set()
        waits[i] = _runqueue_wait_ns() - w0

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter_ns()
    deadline = t0 + int(duration * 1e9)
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.05)
    except KeyboardInterrupt:
        stop.set()
        for th in threads:
            th.join(5)
        raise
    seconds = (time.perf_counter_ns() - t0) / 1e9
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    if errors:
        raise errors[0]
    nbytes = sum(r[0] for r in out if r)
    lats = [x for r in out if r for x in r[1]]
    return nbytes, lats, seconds, CpuUse(cpu, min(1.0, sum(waits) / 1e9 / n / max(seconds, 1e-9)))


def run_forked(n: int, work: Work, duration: float, procs: int) -> tuple[int, list[int], float, CpuUse]:
    """run_threads with the n threads spread over `procs` forked processes (thread ids stay global).

    One Python process runs out of interpreter time (the GIL) long before a fast device runs out of
    IOPS; fio's jobs are separate workers too. Ctrl-C kills the children and re-raises."""
    procs = max(1, min(procs, n))
    if procs == 1:
        return run_threads(n, work, duration)
    shares = [n // procs + (1 if p < n % procs else 0) for p in range(procs)]
    kids: list[tuple[int, int]] = []
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        first = 0
        for share in shares:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # child: run its share, send (bytes, latencies, seconds, wait) or the error back
                code = 1
                try:
                    os.close(r)
                    base = first
                    nbytes, lats, secs, cpu = run_threads(share, lambda i, d, s: work(base + i, d, s), duration)
                    msg = pickle.dumps(("ok", nbytes, np.asarray(lats, np.int64).tobytes(), secs, cpu.wait))
                    code = 0
                except BaseException as e:  # noqa: BLE001 - reported to the parent
                    msg = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
                finally:
                    try:
                        with os.fdopen(w, "wb") as f:
                            f.write(msg)
                    finally:
                        os._exit(code)
            os.close(w)
            kids.append((pid, r))
            first += share
        results = []
        for pid, r in kids:
            with os.fdopen(r, "rb") as f:
                data = f.read()
            os.waitpid(pid, 0)
            results.append(pickle.loads(data) if data else ("error", f"worker {pid} died"))
        kids = []
    except BaseException:
        for pid, _ in kids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        raise
    for res in results:
        if res[0] == "error":
            raise OSError(res[1])
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    lats = [x for res in results for x in np.frombuffer(res[2], np.int64).tolist()]
    waits = sum(res[4] * share for res, share in zip(results, shares)) / n
    return sum(res[1] for res in results), lats, max(res[3] for res in results), CpuUse(cpu, waits)


def _runqueue_wait_ns() -> int:
    """Nanoseconds this thread has spent runnable but not running (Linux schedstat); 0 where unavailable."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def make_point(test: str, mode: str, threads: int, io_size: int, nbytes: int, lats: list[int], seconds: float,
               resident: float | None = None, cpu: CpuUse | None = None) -> Point:
    arr = np.asarray(lats, dtype=np.int64) if lats else np.zeros(1, dtype=np.int64)
    p50, p99 = np.percentile(arr, [50, 99]) / 1e3
    seconds = max(seconds, 1e-9)
    return Point(test, mode, threads, io_size, nbytes, len(lats), round(seconds, 6),
                 round(nbytes / seconds / 2**30, 6), round(len(lats) / seconds, 1), round(float(p50), 2),
                 round(float(p99), 2), resident, None, round(min(1.0, sum(lats) / 1e9 / threads / seconds), 4),
                 round(cpu.seconds, 4) if cpu else 0.0, round(cpu.wait, 4) if cpu else 0.0)


# --- page cache ----------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(path: str) -> float | None:
    """Fraction of the file's pages in the page cache (mincore on a shared mapping); None if unknown."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return None
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return None
            return round(float((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) / pages, 4)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def evict(path: str) -> None:
    """Drop the file's clean pages from the page cache (dirty pages are written first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def probe_direct(directory: str, fs_type: str) -> tuple[bool, str]:
    """Can O_DIRECT bypass the page cache here? (supported, reason) - the reason is shown in reports."""
    if fs_type in ("tmpfs", "ramfs", "devtmpfs"):
        return False, (f"{fs_type} keeps file data in the page cache itself (it may accept O_DIRECT, but nothing is "
                       "bypassed): measured buffered only")
    probe = os.path.join(directory, ".direct-probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError as e:
        return False, (f"open(O_DIRECT) refused by {fs_type} in {directory}: "
                       f"{errno.errorcode.get(e.errno, e.errno)} ({e.strerror}): measured buffered only")
    try:
        buf = mmap.mmap(-1, ALIGN)
        os.pwritev(fd, [buf], 0)
    except OSError as e:
        return False, (f"O_DIRECT write refused by {fs_type} in {directory}: "
                       f"{errno.errorcode.get(e.errno, e.errno)} ({e.strerror}): measured buffered only")
    finally:
        os.close(fd)
        os.unlink(probe)
    return True, f"O_DIRECT works on {fs_type}"


class LocalEngine:
    """Tests on one file of `file_size` bytes inside a scratch directory."""

    def __init__(self, path: str, file_size: int):
        self.path, self.file_size = path, file_size
        self._pattern = mmap.mmap(-1, 8 << 20)
        self._pattern.write(os.urandom(8 << 20))

    def _flags(self, write: bool, mode: str) -> int:
        return (os.O_WRONLY if write else os.O_RDONLY) | (os.O_DIRECT if mode == "direct" else 0)

    def _pattern_view(self, size: int) -> memoryview:
        if size > len(self._pattern):
            self._pattern = mmap.mmap(-1, size)
            self._pattern.write(os.urandom(size))
        return memoryview(self._pattern)[:size]

    def prepare(self, direct: bool) -> None:
        """Write the whole file once (so reads have data and writes overwrite allocated blocks)."""
        chunk = 8 << 20
        fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | (os.O_DIRECT if direct else 0), 0o600)
        try:
            off = 0
            while off < self.file_size:
                n = min(chunk, self.file_size - off)
                os.pwritev(fd, [self._pattern_view(chunk)[:n]], off)
                off += n
            os.fsync(fd)
        finally:
            os.close(fd)
        evict(self.path)

    def _regions(self, threads: int, io_size: int) -> int:
        region = (self.file_size // threads) // io_size * io_size
        if region == 0:
            raise ValueError(f"file of {self.file_size} bytes is too small for {threads} threads x {io_size} bytes")
        return region

    def seq_write(self, threads: int, io_size: int, mode: str, duration: float) -> Point:
        region = self._regions(threads, io_size)
        data = self._pattern_view(io_size)
        fd = os.open(self.path, self._flags(True, mode))
        try:
            def work(i: int, deadline: int, stop: threading.Event) -> tuple[int, list[int]]:
                lats, off, end = [], i * region, (i + 1) * region
                clock = time.perf_counter_ns
                while off < end and not stop.is_set():
                    t = clock()
                    n = os.pwritev(fd, [data], off)
                    lats.append(clock() - t)
                    off += n
                    if t > deadline:
                        break
                    if n != io_size:
                        raise OSError(f"{self.path}: short write of {n} bytes at offset {off}")
                return off - i * region, lats

            nbytes, lats, secs, cpu = run_threads(threads, work, duration)
            t = time.perf_counter_ns()
            os.fsync(fd)
            secs += (time.perf_counter_ns() - t) / 1e9
        finally:
            os.close(fd)
        evict(self.path)
        return make_point("seq_write", mode, threads, io_size, nbytes, lats, secs, cpu=cpu)

    def _read(self, test: str, threads: int, io_size: int, mode: str, duration: float) -> Point:
        evict(self.path)  # direct reads bypass the cache anyway; evicting keeps the residency figures clean
        resident = resident_fraction(self.path)
        fd = os.open(self.path, self._flags(False, mode))
        if test == "rand_read" and mode == "buffered":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: count the pages asked for
        nblocks = self.file_size // io_size
        region = self._regions(threads, io_size) if test == "seq_read" else 0
        bufs = [mmap.mmap(-1, io_size) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
        try:
            def work(i: int, deadline: int, stop: threading.Event) -> tuple[int, list[int]]:
                # Offsets come in batches and the deadline is checked per batch: per-op Python work is
                # what separates a Python benchmark from fio at high IOPS, so keep the loop minimal.
                lats, buf, clock, preadv = [], [bufs[i]], time.perf_counter_ns, os.preadv
                rng = np.random.default_rng(i)
                off, end = i * region, (i + 1) * region
                while not stop.is_set():
                    if test == "seq_read":
                        batch = range(off, min(end, off + BATCH * io_size), io_size)
                        off += BATCH * io_size
                    else:
                        batch = (rng.integers(0, nblocks, BATCH) * io_size).tolist()
                    t = 0
                    for pos in batch:
                        t = clock()
                        n = preadv(fd, buf, pos)
                        lats.append(clock() - t)
                        if n != io_size:
                            raise OSError(f"{self.path}: short read of {n} bytes at offset {pos}")
                    if not batch or t > deadline:
                        break
                return len(lats) * io_size, lats

            nbytes, lats, secs, cpu = run_forked(threads, work, duration, len(os.sched_getaffinity(0)))
        finally:
            os.close(fd)  # the buffers go with their last reference (a stopping thread may still hold one)
        pt = make_point(test, mode, threads, io_size, nbytes, lats, secs, resident, cpu)
        pt.resident_after = resident_fraction(self.path)
        return pt

    def seq_read(self, threads: int, io_size: int, mode: str, duration: float) -> Point:
        return self._read("seq_read", threads, io_size, mode, duration)

    def rand_read(self, threads: int, io_size: int, mode: str, duration: float) -> Point:
        return self._read("rand_read", threads, io_size, mode, duration)

    def close(self) -> None:
        self._pattern.close()
