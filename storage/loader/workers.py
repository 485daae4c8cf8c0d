"""Batch-building worker processes: forked copies of the loader build every N-th batch into shared
memory, and the training process hands those batches out without copying them.

Threads of one process pass the GIL back and forth, and on a small VM every hand-over that puts a
thread to sleep costs tens of microseconds: a packing thread beside decode threads and a consumer
thread loses about half its speed (tools/bench/diag_gil_contention.py). Worker processes share no
GIL. Worker w of N builds this rank's batches w, w + N, w + 2N, ... (the split TokenIterableDataset
uses), so the order is unchanged and the loader state stays the consumer's count of batches.

Each worker owns `slots` batch-sized slots of one anonymous shared mapping made before the fork. Two
pipes per worker carry slot numbers: `free` (consumer → worker: slots the worker may fill; it starts
full) and `ready` (worker → consumer, in batch order). A batch is handed out as a tensor viewing its
slot; the slot goes back to the worker when that tensor and every view of it are freed. When a
consumer holds all but one slot of a worker (say, gradient accumulation keeping micro-batches), the
next batch is copied out and its slot returned at once, so held batches never stall the ring and are
never overwritten. A worker's exception travels in its slot (pickled) and is raised in order; a
worker that dies is reported with its exit code; workers exit when the consumer's end of `free`
closes (the training process exited or closed the loader).
"""
from __future__ import annotations

import fcntl
import gc
import mmap
import multiprocessing as mp
import os
import pickle
import select
import signal
import termios
import threading
import weakref

import numpy as np
import torch

from storage.config import ConfigError
from storage.loader.prefetch import BlockStore

_HEADER = 8  # int64 words before each slot's batch: [status, payload bytes, ...]
_MIN_PAYLOAD = 8192  # words: room for a pickled exception however small the batch
_BATCH, _ERROR = 0, 1
_METRICS = ("bytes_read", "blocks_read", "bytes_in_flight", "bytes_cached", "peak_bytes_in_flight",
            "quarantined_blocks", "substituted_sequences")


class WorkerPool:
    def __init__(self, loader, workers: int, slots: int):
        """Fork `workers` copies of `loader` (which must not have started its producer thread)."""
        if mp.current_process().daemon:
            raise ConfigError("key 'workers': a daemonic process (e.g. a torch DataLoader worker) cannot fork "
                              "loader workers; use workers: 0 there")
        self.n, self.slots = workers, slots
        self.shape = (loader.rows, loader.cfg.seq_len + 1)
        self.slot_words = _HEADER + max(self.shape[0] * self.shape[1], _MIN_PAYLOAD)
        self._mem = mmap.mmap(-1, 8 * (workers * slots * self.slot_words + workers * len(_METRICS)))
        words = np.frombuffer(self._mem, dtype=np.int64)
        self._slots = words[:workers * slots * self.slot_words].reshape(workers, slots, self.slot_words)
        self._metrics = words[workers * slots * self.slot_words:].reshape(workers, len(_METRICS))
        self._held = [0] * workers  # slots handed out zero-copy and not yet freed, per worker
        self._lock = threading.Lock()
        self.free_w: list[int] = []
        self.ready_r: list[int] = []
        pipes = []
        for _ in range(workers):
            free_r, free_w = os.pipe()
            ready_r, ready_w = os.pipe()
            os.write(free_w, bytes(range(slots)))
            pipes.append((free_r, free_w, ready_r, ready_w))
        ctx = mp.get_context("fork")
        self.procs = []
        for w in range(workers):
            p = ctx.Process(target=_worker_main, args=(loader, w, workers, self, pipes), daemon=True,
                            name=f"smoltrain-loader-{w}")
            p.start()
            self.procs.append(p)
        for free_r, free_w, ready_r, ready_w in pipes:  # the workers' ends
            os.close(free_r)
            os.close(ready_w)
            os.set_blocking(ready_r, False)
            self.free_w.append(free_w)
            self.ready_r.append(ready_r)
        self._closed = False

    # ---- consumer side ----
    def take(self, k: int) -> torch.Tensor:
        """This pool's k-th batch (k counts from the pool's start)."""
        w = k % self.n
        slot = self._next_slot(w)
        head = self._slots[w, slot, :_HEADER]
        if head[0] == _ERROR:
            exc = pickle.loads(self._slots[w, slot, _HEADER:].view(np.uint8)[:int(head[1])].tobytes())
            raise exc
        arr = self._slots[w, slot, _HEADER:_HEADER + self.shape[0] * self.shape[1]].reshape(self.shape)
        with self._lock:
            keep = self._held[w] < self.slots - 1
            if keep:
                self._held[w] += 1
        if not keep:  # copy out, so the worker can go on while the consumer keeps its earlier batches
            out = torch.from_numpy(arr.copy())
            self._give_back(w, slot, held=False)
            return out
        view = arr.view()
        weakref.finalize(view, self._give_back, w, slot, True)
        return torch.from_numpy(view)

    def _next_slot(self, w: int) -> int:
        fd = self.ready_r[w]
        while True:
            try:
                got = os.read(fd, 1)  # non-blocking: no select() call when the batch is already there
            except BlockingIOError:
                select.select([fd], [], [], 1.0)  # readable once a slot number or EOF arrives
                continue
            if got:
                return got[0]
            p = self.procs[w]  # EOF: the worker's end closed, so it has exited
            p.join(timeout=5)
            raise RuntimeError(f"loader worker {w} (pid {p.pid}) exited with code {p.exitcode} before sending its "
                               "next batch (killed, or out of memory?)")

    def _give_back(self, w: int, slot: int, held: bool) -> None:
        with self._lock:
            if held:
                self._held[w] -= 1
            if not self._closed:
                os.write(self.free_w[w], bytes([slot]))

    def ready(self) -> int:
        """Batches built and waiting in the rings."""
        total, buf = 0, np.zeros(1, dtype=np.int32)
        for fd in self.ready_r:
            fcntl.ioctl(fd, termios.FIONREAD, buf)  # bytes waiting in the pipe = slot numbers sent
            total += int(buf[0])
        return total

    def metrics(self) -> dict:
        return {k: int(v) if k != "peak_bytes_in_flight" else int(self._metrics[:, i].max())
                for i, (k, v) in enumerate(zip(_METRICS, self._metrics.sum(axis=0)))}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in self.free_w:  # EOF on `free`: each worker stops after its current batch
                os.close(fd)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for fd in self.ready_r:
            os.close(fd)


def _worker_main(loader, w: int, n: int, pool: WorkerPool, pipes) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    gc.freeze()  # the collector leaves the inherited objects alone, so their pages stay shared, not copied
    for i, (free_r, free_w, ready_r, ready_w) in enumerate(pipes):
        os.close(free_w)  # so the consumer's exit (its end closing) reads as EOF here
        os.close(ready_r)
        if i != w:
            os.close(free_r)
            os.close(ready_w)
    free_r, ready_w = pipes[w][0], pipes[w][3]
    loader.batch_offset += w * loader.batch_stride
    loader.batch_stride *= n
    cfg, old = loader.cfg, loader.store
    loader.store = BlockStore(old.refs, old.block_tokens, old.itemsize, cfg.worker_threads(), cfg.max_bytes_in_flight)
    loader.packer.store = loader.store
    ring, stats = pool._slots[w], pool._metrics[w]
    batches = loader._batches()
    while True:
        got = os.read(free_r, 1)
        if not got:
            return
        slot = got[0]
        try:
            p = next(batches)
            loader.packer.assemble(p, out=ring[slot, _HEADER:_HEADER + pool.shape[0] * pool.shape[1]].reshape(pool.shape))
            ring[slot, 0] = _BATCH
            s = loader.store
            stats[:] = (s.bytes_read, s.blocks_read, s.bytes_in_flight, s.bytes_idle, s.peak_bytes_in_flight,
                        len(s.bad), loader.packer.substituted)
        except BaseException as e:  # noqa: BLE001 - delivered to the consumer in order, then this worker ends
            try:
                blob = pickle.dumps(e)
                pickle.loads(blob)
            except Exception:  # noqa: BLE001 - an unpicklable exception still reaches the consumer as text
                blob = pickle.dumps(RuntimeError(f"loader worker {w}: {type(e).__name__}: {e}"))
            if len(blob) > 8 * (pool.slot_words - _HEADER):
                blob = pickle.dumps(RuntimeError(f"loader worker {w}: {type(e).__name__}: {str(e)[:4096]}"))
            ring[slot, 0], ring[slot, 1] = _ERROR, len(blob)
            ring[slot, _HEADER:].view(np.uint8)[:len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            os.write(ready_w, bytes([slot]))
            return
        os.write(ready_w, bytes([slot]))
