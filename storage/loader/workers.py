"""Batch-building worker processes: forked copies of the loader build every batch together in shared
memory, and the training process hands those batches out without copying them.

Threads of one process pass the GIL back and forth, and on a small VM every hand-over that puts a
thread to sleep costs tens of microseconds: a packing thread beside decode threads and a consumer
thread loses about half its speed (tools/bench/diag_gil_contention.py). Worker processes share no
GIL. Each batch is split among the N workers by where its rows come from: worker p builds the rows
drawn from the p-th of N stretches of their source's shuffle window (SourceOrder.part_of), so each
worker reads and decodes about 1/N of every window's blocks, not all of them, and writes its rows
into the batch's slot. The order and the loader state are those of the thread.

The ring is `slots` batch-sized slots of one anonymous shared mapping made before the fork. Two
channels per worker (a ring of words in the same mapping plus a semaphore) carry slot numbers: `free`
(consumer → worker: slots to fill, the same sequence to every worker) and `ready` (worker → consumer,
in batch order); a batch is complete when every worker has reported its slot. A batch is handed out as a tensor viewing its slot; the slot goes back to the
workers when that tensor and every view of it are freed. When a consumer holds all but one slot (say,
gradient accumulation keeping micro-batches), the next batch is copied out and its slot returned at
once, so held batches never stall the ring and are never overwritten. A worker's exception travels
pickled in the worker's error area and is raised in order; a worker that dies is reported with its
exit code; workers exit when the consumer closes the pool or its process is gone.
"""
from __future__ import annotations

import gc
import mmap
import multiprocessing as mp
import os
import pickle
import signal
import threading
import weakref

import numpy as np
import torch

from storage.config import ConfigError
from storage.loader.prefetch import BlockStore

_BATCH, _ERROR = 0, 1
_ERROR_BYTES = 1 << 16  # per worker: room for its pickled exception
_METRICS = ("bytes_read", "blocks_read", "bytes_in_flight", "bytes_cached", "peak_bytes_in_flight",
            "quarantined_blocks", "substituted_sequences")


class _Channel:
    """Slot numbers from one process to another: a ring of int64 words in shared memory and a semaphore.
    One process puts, one gets; post and wait stay in user space unless the getter sleeps, so a batch costs
    no system call when the other side is not waiting (pipes cost one write and one read every time)."""

    def __init__(self, ctx, words: np.ndarray):
        self.words, self.sem = words, ctx.Semaphore(0)
        self.head = self.tail = 0  # each side uses its own (its forked copy)

    def put(self, x: int) -> None:
        self.words[self.head % len(self.words)] = x
        self.head += 1
        self.sem.release()

    def get(self, timeout: float) -> int | None:
        if not self.sem.acquire(timeout=timeout):
            return None
        x = int(self.words[self.tail % len(self.words)])
        self.tail += 1
        return x


class WorkerPool:
    def __init__(self, loader, workers: int, slots: int):
        """Fork `workers` copies of `loader` (which must not have started its producer thread)."""
        if mp.current_process().daemon:
            raise ConfigError("key 'workers': a daemonic process (e.g. a torch DataLoader worker) cannot fork "
                              "loader workers; use workers: 0 there")
        if loader.batch_stride != 1 or loader.batch_offset != 0:
            raise ConfigError("key 'workers': not with batch_offset/batch_stride (TokenIterableDataset); use one")
        self.n, self.slots = workers, slots
        self.shape = (loader.rows, loader.cfg.seq_len + 1)
        batch_words = self.shape[0] * self.shape[1]
        # per slot: one status word per worker, then the batch; then per worker: metrics, two channels
        self.slot_words = workers + batch_words
        n_words = slots * self.slot_words + workers * (len(_METRICS) + 2 * slots) + 1
        self._mem = mmap.mmap(-1, 8 * n_words + workers * _ERROR_BYTES)
        words = np.frombuffer(self._mem, dtype=np.int64, count=n_words)
        self._slots = words[:slots * self.slot_words].reshape(slots, self.slot_words)
        rest = words[slots * self.slot_words:-1].reshape(workers, len(_METRICS) + 2 * slots)
        self._metrics = rest[:, :len(_METRICS)]
        self._stop = words[-1:]  # 1: the consumer closed the pool
        self._errors = np.frombuffer(self._mem, dtype=np.uint8, offset=words.nbytes).reshape(workers, _ERROR_BYTES)
        self._held = 0  # slots handed out zero-copy and not yet freed
        self._lock = threading.Lock()
        self._closed = False
        ctx = mp.get_context("fork")
        m = len(_METRICS)
        self.free = [_Channel(ctx, rest[w, m:m + slots]) for w in range(workers)]  # consumer → worker w
        self.ready = [_Channel(ctx, rest[w, m + slots:]) for w in range(workers)]  # worker w → consumer
        for ch in self.free:
            for slot in range(slots):
                ch.put(slot)
        self.parent = os.getpid()
        self.procs = []
        for w in range(workers):
            p = ctx.Process(target=_worker_main, args=(loader, w, self), daemon=True, name=f"smoltrain-loader-{w}")
            p.start()
            self.procs.append(p)

    # ---- consumer side ----
    def take(self) -> torch.Tensor:
        """The next batch."""
        slot = -1
        for w in range(self.n):  # every worker reports the slot once its rows are in
            got = self._next_slot(w)
            if self._slots[got, w] == _ERROR:
                raise pickle.loads(self._errors[w].tobytes())
            assert slot in (-1, got), (slot, got)
            slot = got
        arr = self._slots[slot, self.n:].reshape(self.shape)
        with self._lock:
            keep = self._held < self.slots - 1
            if keep:
                self._held += 1
        if not keep:  # copy out, so the workers go on while the consumer keeps its earlier batches
            out = torch.from_numpy(arr.copy())
            self._give_back(slot, held=False)
            return out
        view = arr.view()
        weakref.finalize(view, self._give_back, slot, True)
        return torch.from_numpy(view)

    def _next_slot(self, w: int) -> int:
        while True:
            got = self.ready[w].get(timeout=1.0)
            if got is not None:
                return got
            p = self.procs[w]
            if not p.is_alive():
                got = self.ready[w].get(timeout=0)  # it may have sent its last batch before exiting
                if got is not None:
                    return got
                raise RuntimeError(f"loader worker {w} (pid {p.pid}) exited with code {p.exitcode} before sending "
                                   "its next batch (killed, or out of memory?)")

    def _give_back(self, slot: int, held: bool) -> None:
        with self._lock:
            if held:
                self._held -= 1
            if not self._closed:
                for ch in self.free:
                    ch.put(slot)

    def ready_batches(self) -> int:
        """Batches complete in the ring."""
        return min(ch.sem.get_value() for ch in self.ready)

    def metrics(self) -> dict:
        """The workers' block counters, summed (a corrupt block at the seam of two workers' stretches counts
        once per worker that met it)."""
        return {k: int(v) for k, v in zip(_METRICS, self._metrics.sum(axis=0))}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop[0] = 1
            for ch in self.free:  # wakes a worker waiting for a slot; it sees the stop word and exits
                ch.sem.release()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _worker_main(loader, w: int, pool: WorkerPool) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    gc.freeze()  # the collector leaves the inherited objects alone, so their pages stay shared, not copied
    loader._part = (w, pool.n) if pool.n > 1 else None
    cfg, old = loader.cfg, loader.store
    loader.store = BlockStore(old.refs, old.block_tokens, old.itemsize, cfg.worker_threads(), cfg.max_bytes_in_flight)
    loader.packer.store = loader.store
    if cfg.decoders():
        loader.store.use_decoders(cfg.decoders())
    try:
        _build(loader, w, pool)
    finally:
        loader.store.close()


def _next_free(pool: WorkerPool, w: int) -> int | None:
    """A slot to fill, or None when the consumer closed the pool or its process is gone."""
    while True:
        slot = pool.free[w].get(timeout=1.0)
        if pool._stop[0] or os.getppid() != pool.parent:
            return None
        if slot is not None:
            return slot


def _build(loader, w: int, pool: WorkerPool) -> None:
    stats = pool._metrics[w]
    batches = loader._batches()
    while (slot := _next_free(pool, w)) is not None:
        try:
            loader.packer.assemble(next(batches), out=pool._slots[slot, pool.n:].reshape(pool.shape))
            pool._slots[slot, w] = _BATCH
            s = loader.store
            stats[:] = (s.bytes_read, s.blocks_read, s.bytes_in_flight, s.bytes_idle, s.peak_bytes_in_flight,
                        len(s.bad), loader.packer.substituted)
        except BaseException as e:  # noqa: BLE001 - delivered to the consumer in order, then this worker ends
            try:
                blob = pickle.dumps(e)
                pickle.loads(blob)
            except Exception:  # noqa: BLE001 - an unpicklable exception still reaches the consumer as text
                blob = pickle.dumps(RuntimeError(f"loader worker {w}: {type(e).__name__}: {e}"))
            if len(blob) > _ERROR_BYTES:
                blob = pickle.dumps(RuntimeError(f"loader worker {w}: {type(e).__name__}: {str(e)[:8192]}"))
            pool._errors[w, :len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            pool._slots[slot, w] = _ERROR
            pool.ready[w].put(slot)
            return
        pool.ready[w].put(slot)
