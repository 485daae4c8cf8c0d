"""Decode processes: blocks are read, verified and LZ4-decoded by forked processes into a shared arena,
instead of by prefetch threads that share the packing thread's GIL.

A BlockStore given a `DecoderPool` submits each block it plans to one of the processes (round robin)
as (block id, arena slot) over a pipe; the process decodes into that slot of the store's arena (an
anonymous shared mapping made before the fork) and answers (slot, tokens, bytes read, status) on its
own pipe, in request order. The store's thread reads answers only when it needs a block, so a block decoded ahead
costs it one read() of 32 bytes. A corrupt block comes back as the pickled ShardError, in its slot;
a decoder that dies is reported with its exit code; decoders exit when their request pipe closes or
their owner dies. Decoders are forked with os.fork by the process that uses them (the training
process in thread mode, each worker process in worker mode), which also reaps them; a decoder closes
every inherited pipe but its own two. Local datasets only (shards are memory-mapped).
Slots are the store's, reused last-freed first, so the arena's touched pages stay near the blocks in
flight.
"""
from __future__ import annotations

import gc
import mmap
import os
import pickle
import select
import signal
import stat
import struct
import time
from collections import deque

import numpy as np

_REQ = struct.Struct("<qq")     # block id, slot
_DONE = struct.Struct("<qqqq")  # slot, tokens (or pickled-error bytes), bytes read, status
_OK, _ERROR = 0, 1


class Pending:
    """A block submitted to a decoder: result() waits for it (the store's Future)."""
    __slots__ = ("bid", "error", "freed", "pool", "proc", "slot", "tokens")

    def __init__(self, pool: DecoderPool, bid: int, proc: int, slot: int):
        self.pool, self.bid, self.proc, self.slot = pool, bid, proc, slot
        self.tokens: np.ndarray | None = None
        self.error: BaseException | None = None
        self.freed = False

    def done(self) -> bool:
        return self.tokens is not None or self.error is not None

    def result(self) -> tuple[np.ndarray, int | None]:
        """(tokens, arena slot or -1); a job the arena had no room for is decoded here, into a private buffer."""
        if self.proc < 0 and not self.done():
            try:
                self.tokens = self.pool.store._load(self.bid, False)[0]
            except Exception as e:  # noqa: BLE001 - kept for result(), as a decoder's error would be
                self.error = e
        while not self.done():
            self.pool._answer(self.proc)
        if self.error is not None:
            raise self.error
        return self.tokens, self.slot


class DecoderPool:
    def __init__(self, store, processes: int):
        """Fork `processes` decoders for `store` (a BlockStore of a local dataset, its arena made)."""
        self.store, self.n = store, processes
        self.arena = store.arena()
        self._waiting: list[deque[Pending]] = [deque() for _ in range(processes)]
        self._next = 0
        pipes = [os.pipe() + os.pipe() for _ in range(processes)]  # (req_r, req_w, done_r, done_w)
        # set by close(): decoders stop at once instead of decoding the prefetch requests still queued
        self._closing = mmap.mmap(-1, mmap.PAGESIZE)
        self.pids, owner = [], os.getpid()
        for i in range(processes):
            pid = os.fork()
            if pid == 0:  # the decoder: plain os.fork, so a daemonic process (a DataLoader worker) may own one
                code = 1
                try:
                    _decoder_main(self, i, pipes, owner)
                    code = 0
                finally:
                    os._exit(code)
            self.pids.append(pid)
        self.req_w = [q[1] for q in pipes]
        self.done_r = [q[2] for q in pipes]
        for req_r, _, _, done_w in pipes:
            os.close(req_r)
            os.close(done_w)
        self.exitcodes: dict[int, int] = {}

    def submit(self, bid: int) -> Pending:
        """Queue block `bid`; when every slot holds a block (many small blocks within the byte budget) the
        block is decoded by the asking thread instead, on result()."""
        slot = self.store.take_slot()
        if slot < 0:
            return Pending(self, bid, -1, -1)
        proc, self._next = self._next, (self._next + 1) % self.n
        job = Pending(self, bid, proc, slot)
        self._waiting[proc].append(job)
        try:
            os.write(self.req_w[proc], _REQ.pack(bid, slot))
        except BrokenPipeError:  # the decoder is gone: say how it ended
            self._check_alive(proc, wait=True)
            raise
        return job

    def free(self, job: Pending) -> None:
        """The block's slot may take another block (once its decode has finished)."""
        job.freed = True
        if job.done() and job.slot >= 0:
            self.store.free_slots.append(job.slot)

    def _answer(self, proc: int) -> None:
        """Read the next answer of decoder `proc` and settle its oldest waiting job."""
        fd = self.done_r[proc]
        while not select.select([fd], [], [], 1.0)[0]:
            self._check_alive(proc)
        msg = _read_exact(fd, _DONE.size)
        if msg is None:
            self._check_alive(proc, wait=True)
        slot, n, nbytes, status = _DONE.unpack(msg)
        job = self._waiting[proc].popleft()
        if status == _OK:
            job.tokens = self.arena[slot, :n]
            self.store.count_read(nbytes)
        else:
            job.error = pickle.loads(self.arena[slot].view(np.uint8)[:n].tobytes())
        if job.freed:
            self.store.free_slots.append(slot)

    def _check_alive(self, proc: int, wait: bool = False) -> None:
        pid = self.pids[proc]
        got, status = os.waitpid(pid, 0 if wait else os.WNOHANG)
        if got:
            code = os.waitstatus_to_exitcode(status)
            self.exitcodes[proc] = code
            raise RuntimeError(f"loader decode process {proc} (pid {pid}) exited with code {code} "
                               "(killed, or out of memory?)")

    def close(self) -> None:
        self._closing[0] = 1
        for fd in self.req_w:  # EOF: each decoder exits
            os.close(fd)
        for i, pid in enumerate(self.pids):
            if i in self.exitcodes:
                continue
            for _ in range(50):
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    break
                time.sleep(0.002)
            else:  # another process holds our pipe's end open: stop it ourselves
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
            self.exitcodes[i] = os.waitstatus_to_exitcode(status)
        for fd in self.done_r:
            os.close(fd)
        self.req_w, self.done_r = [], []


def _read_exact(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        got = os.read(fd, n - len(data))
        if not got:
            return None
        data += got
    return data


def _close_other_pipes(keep: tuple[int, ...]) -> None:
    """Close every inherited pipe but `keep`: another loader's pipe end held open here would hide that
    loader's EOFs (files and sockets stay: memory maps and open datasets may use them)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd in keep:
            continue
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            pass


def _decoder_main(pool: DecoderPool, i: int, pipes, owner: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    # The collector would walk (and so copy, page by page) the parent's inherited heap; the decode loop
    # makes no reference cycles, so it runs without it.
    gc.freeze()
    gc.disable()
    req_r, done_w = pipes[i][0], pipes[i][3]
    _close_other_pipes((req_r, done_w))
    store, arena = pool.store, pool.arena
    while True:
        while not select.select([req_r], [], [], 1.0)[0]:
            if os.getppid() != owner:  # the owner died without closing (and another process holds its end)
                return
        msg = _read_exact(req_r, _REQ.size)
        if msg is None or pool._closing[0]:
            return
        bid, slot = _REQ.unpack(msg)
        try:
            tokens, nbytes = store.read_decode(bid, arena[slot])
            answer = _DONE.pack(slot, len(tokens), nbytes, _OK)
        except Exception as e:  # noqa: BLE001 - the store raises it where the block is needed
            blob = pickle.dumps(e)
            if len(blob) > arena[slot].nbytes:
                blob = pickle.dumps(RuntimeError(f"{type(e).__name__}: {str(e)[:arena[slot].nbytes - 512]}"))
            arena[slot].view(np.uint8)[:len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            answer = _DONE.pack(slot, len(blob), 0, _ERROR)
        os.write(done_w, answer)
