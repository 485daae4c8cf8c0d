"""Write a stream of byte buffers to a new local file at storage speed, hashing it on the way.

Full checkpoints are hundreds of MiB to GiB per rank. Buffered writes first fill the page cache, which
costs a page fault per 4 KiB of new cache (expensive on VMs, and it evicts the training job's own cache)
and leaves all the disk work to the final fsync. Here the bytes are copied into aligned bounce buffers
and written with O_DIRECT by a small pool of I/O threads, so the copy of the next buffer overlaps the
disk write of the previous ones and nothing is left to flush at the end. Where O_DIRECT is refused
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
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from storage import codec

CHUNK = 8 << 20
BUFFERS = 3     # bounce buffers: up to BUFFERS - 1 writes queued while the next one is filled
IO_THREADS = 1  # one writer in file order, like the sequential-write reference (more were slower on virtio)
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


def write_stream(path: str, parts: list[memoryview]) -> tuple[int, str]:
    """Write the concatenation of `parts` (byte memoryviews) to the file at `path` (created, or overwritten
    in place and cut to size), fsynced. Returns (size, XXH3-128 hex digest)."""
    total = sum(len(p) for p in parts)
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
    h, off, k, fill = codec.Xxh3_128(), 0, 0, 0
    io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="ckpt-io")
    hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")  # in order; overlaps the next copy

    def flush(b: int, n: int) -> None:
        nonlocal off, k
        size = -(-n // _ALIGN) * _ALIGN if direct else n  # O_DIRECT writes whole blocks; truncated below
        hashed = hasher.submit(h.update, memoryview(bufs[b])[:n])

        def write(b=b, size=size, at=off, hashed=hashed):
            _pwrite_all(fd, memoryview(bufs[b])[:size], at)
            if not direct:
                _start_writeback(fd, at, size)
            hashed.result()  # the buffer is free for the next chunk once written and hashed
        pending[b] = io.submit(write)
        off += n
        k += 1

    try:
        for part in parts:
            src = np.frombuffer(part, dtype=np.uint8)
            pos = 0
            while pos < len(src):
                b = k % BUFFERS
                if fill == 0 and pending[b] is not None:
                    pending[b].result()  # this buffer's previous write is done
                take = min(CHUNK - fill, len(src) - pos)
                views[b][fill:fill + take] = src[pos:pos + take]
                fill, pos = fill + take, pos + take
                if fill == CHUNK:
                    flush(b, fill)
                    fill = 0
        if fill:
            flush(k % BUFFERS, fill)
        for p in pending:
            if p is not None:
                p.result()
        os.ftruncate(fd, off)  # O_DIRECT wrote whole blocks; a recycled file may be longer
        os.fsync(fd)
    finally:
        io.shutdown(wait=True)
        hasher.shutdown(wait=True)
        os.close(fd)
    return off, h.hexdigest()
