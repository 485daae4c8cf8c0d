"""Write a stream of byte buffers to a new local file at storage speed, hashing it on the way.

Full checkpoints are hundreds of MiB to GiB per rank. Buffered writes first fill the page cache, which
costs a page fault per 4 KiB of new cache (expensive on VMs, and it evicts the training job's own cache)
and leaves all the disk work to the final fsync. Here the bytes are copied into aligned bounce buffers
and written with O_DIRECT by a small pool of I/O threads, so the copy of the next buffer overlaps the
disk write of the previous ones and nothing is left to flush at the end. Parts placed at file offsets
congruent to their memory addresses (aligned_offsets; full checkpoints do this) skip the copy: their
page-aligned middles are written straight from their own memory. Where O_DIRECT is refused
(tmpfs, some network filesystems) the file is written through the page cache with Linux
sync_file_range starting the writeback of each chunk as soon as it is written.
The XXH3-128 of the stream is computed from the hot bounce buffers (GIL released, in order, beside the
copy of the next buffer), so the commit need not read it back.
An existing file at `path` (a recycled one, see incremental.retire) is overwritten in place and cut to
size: overwriting allocated blocks is faster than allocating new ones.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from storage import codec

CHUNK = 8 << 20
BUFFERS = 3     # bounce buffers: up to BUFFERS - 1 writes queued while the next one is filled
IO_THREADS = 4  # writes in flight at once: with one, the device idles between a write's end and the next
_ALIGN = 4096


def _writeback_starter():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return lambda fd, off, n: None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, off, n: fn(fd, off, n, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, do not wait


_start_writeback = _writeback_starter()


def _pwrite_all(fd: int, buf: memoryview, off: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, off)
        buf, off = buf[n:], off + n


def aligned_offsets(parts: list[memoryview]) -> list[int]:
    """File offsets for `parts` in order, each congruent to the part's memory address modulo 4 KiB, so
    the page-aligned middle of every part can go to disk with O_DIRECT straight from its memory; the
    gaps between parts (under 4 KiB each) hold zeros."""
    out, pos = [], 0
    for p in parts:
        if len(p):
            pos += (np.frombuffer(p, dtype=np.uint8).ctypes.data - pos) % _ALIGN
        out.append(pos)
        pos += len(p)
    return out


def _back_to_back(parts: Iterable[memoryview]):
    pos = 0
    for p in parts:
        yield p, pos
        pos += len(p)


def write_stream(path: str, parts: Iterable[memoryview], offsets: list[int] | None = None,
                 copy: bool = False) -> tuple[int, str]:
    """Write `parts` (byte memoryviews) at file `offsets` (default: back to back, as an iterable yields
    them, e.g. while they are being made; gaps are zeros) to the file at `path` (created, or overwritten in
    place and cut to size), fsynced. With O_DIRECT, a part whose offset is congruent to its address modulo
    4 KiB (see aligned_offsets) is written from its own memory, only its unaligned ends going through the
    bounce buffers; with `copy` every part goes through the bounce buffers, so its memory may be reused
    once the next part is asked for. Returns (size, XXH3-128 hex)."""
    if offsets is None:
        total = None  # known at the end
        placed: Iterable = _back_to_back(parts)
    else:
        parts = list(parts)
        total = max((o + len(p) for o, p in zip(offsets, parts)), default=0)
        placed = zip(parts, offsets)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
        direct = hasattr(os, "O_DIRECT")
    except OSError:  # EINVAL: the filesystem does not do O_DIRECT
        fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), False
    if total and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, total)  # allocate the extents once, not per write
        except OSError:  # not supported here: allocate on write
            pass
    bufs = [mmap.mmap(-1, CHUNK) for _ in range(BUFFERS)]  # page-aligned, as O_DIRECT needs
    views = [np.frombuffer(b, dtype=np.uint8) for b in bufs]
    pending: list[Future | None] = [None] * BUFFERS
    straight: list[Future] = []
    h = codec.Xxh3_128()
    io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="ckpt-io")
    hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")  # in file order, beside the I/O
    zeros = np.zeros(_ALIGN, dtype=np.uint8)
    b, acc_off, fill = 0, 0, 0  # the bounce buffer bufs[b] holds the file's bytes [acc_off, acc_off + fill)

    def submit(view: memoryview, at: int, n: int) -> Future:
        """Hash the file's n bytes at `at` (view[:n]) and write them (whole blocks when direct)."""
        size = -(-n // _ALIGN) * _ALIGN if direct else n
        hashed = hasher.submit(h.update, view[:n])

        def write():
            _pwrite_all(fd, view[:size], at)
            if not direct:
                _start_writeback(fd, at, size)
            hashed.result()  # a bounce buffer is free for the next bytes once written and hashed
        return io.submit(write)

    def flush(whole_blocks: bool) -> None:
        nonlocal b, acc_off, fill
        n = fill - fill % _ALIGN if direct and whole_blocks else fill
        if not n:
            return
        pending[b] = submit(memoryview(bufs[b]), acc_off, n)
        nb, rest = (b + 1) % BUFFERS, fill - n
        if pending[nb] is not None:
            pending[nb].result()
        views[nb][:rest] = views[b][n:fill]
        b, acc_off, fill = nb, acc_off + n, rest

    def add(src: np.ndarray) -> None:
        nonlocal fill
        pos = 0
        while pos < len(src):
            take = min(CHUNK - fill, len(src) - pos)
            views[b][fill:fill + take] = src[pos:pos + take]
            fill, pos = fill + take, pos + take
            if fill == CHUNK:
                flush(True)

    end = 0
    try:
        for part, o in placed:
            end = max(end, o + len(part))
            while acc_off + fill < o:  # the gap before this part
                add(zeros[:min(_ALIGN, o - acc_off - fill)])
            src = np.frombuffer(part, dtype=np.uint8)
            lo, hi = -(-o // _ALIGN) * _ALIGN, (o + len(src)) // _ALIGN * _ALIGN  # its aligned middle
            if direct and not copy and hi - lo >= _ALIGN and (src.ctypes.data - o) % _ALIGN == 0:
                add(src[:lo - o])
                flush(True)  # the bounce buffer now ends where the middle starts, on a block boundary
                for at in range(lo, hi, CHUNK):
                    n = min(CHUNK, hi - at)
                    straight.append(submit(part[at - o:at - o + n], at, n))
                acc_off = hi
                add(src[hi - o:])
            else:
                add(src)
        flush(False)
        for f in pending + straight:
            if f is not None:
                f.result()
        total = end if total is None else total
        os.ftruncate(fd, total)  # O_DIRECT wrote whole blocks; a recycled file may be longer
        os.fsync(fd)
    finally:
        io.shutdown(wait=True)
        hasher.shutdown(wait=True)
        os.close(fd)
    return total, h.hexdigest()
