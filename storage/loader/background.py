"""`BackgroundBatches`: the producer thread, two-slot queue and position state shared by the document
loaders (`ConversationLoader`, `PairLoader`, `PromptLoader`); `EpochShuffle` and `BlockCache`: the per-epoch
permutation of whole units and the decoded-block cache of the loaders that hand out units one by one
(`PairLoader`, `PromptLoader`).

A subclass sets KIND (its state's name), WHAT (its order, for errors) and THREAD, and implements
`build(first, count)`: this rank's `count` units (rows or pairs) starting at global unit `first`. Global
batch i holds units [i·G, (i+1)·G); DP rank r takes [i·G + r·n, i·G + (r+1)·n) with n = G / W. State is the
number of units consumed plus the subclass's `fingerprint`, so a resume may change the DP size.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from storage.loader.buffers import Failure, TwoSlotQueue
from storage.loader.order import _rng

STATE_VERSION = 1


class BackgroundBatches:
    KIND = ""
    WHAT = ""
    THREAD = "loader"

    def _start_state(self, global_batch: int, per_rank: int, rank: int) -> None:
        self.G, self._per_rank, self.rank = global_batch, per_rank, rank
        self.consumed = 0   # global units before the next batch this loader hands out
        self._built = 0     # global units the producer thread has built batches for
        self._buf = TwoSlotQueue(2)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._m = {"wait_s": 0.0, "units": 0, "tokens": 0, "t0": None, "blocks_read": 0}

    def build(self, first: int, count: int) -> torch.Tensor:
        raise NotImplementedError

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.build(self._built + self.rank * self._per_rank, self._per_rank)
                self._built += self.G
                if not self._buf.put(batch, self._stop):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._buf.put(Failure(e), self._stop)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self._thread is None:
            self._built = self.consumed
            self._stop.clear()
            self._thread = threading.Thread(target=self._produce, name=self.THREAD, daemon=True)
            self._thread.start()
            self._m["t0"] = time.perf_counter()
        t = time.perf_counter()
        item = self._buf.get(alive=lambda: self._thread is not None and self._thread.is_alive())
        self._m["wait_s"] += time.perf_counter() - t
        if isinstance(item, Failure):
            raise item.exc
        self.consumed += self.G
        self._m["units"] += self._per_rank
        return item

    def elapsed(self) -> float:
        return time.perf_counter() - self._m["t0"] if self._m["t0"] else 0.0

    # ---- state ----
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": self.KIND, "consumed": self.consumed,
                "config": dict(self.fingerprint)}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != STATE_VERSION or sd.get("kind") != self.KIND:
            raise ValueError(f"loader state {sd.get('kind', 'token stream')!r} v{sd.get('version')} is not a "
                             f"{self.WHAT} state v{STATE_VERSION} (was the run trained with another objective?)")
        for key, ours in self.fingerprint.items():
            if sd["config"].get(key) != ours:
                raise ValueError(f"loader state was made with {key}={sd['config'].get(key)!r}, this loader has "
                                 f"{key}={ours!r}; resuming would change the {self.WHAT} order")
        self._shutdown()
        self.consumed = int(sd["consumed"])

    # ---- lifecycle ----
    def _shutdown(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._buf.drain()
            self._thread.join()
            self._thread = None
        self._buf.drain()

    def close(self) -> None:
        self._shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EpochShuffle:
    """Units 0..n-1 (pairs, prompts) permuted afresh each epoch, seeded by (seed, salt, epoch); global unit g
    is unit `ordinals(g, 1)[0]` of the epochs laid end to end. The last two permutations stay cached."""

    def __init__(self, n: int, seed: int, salt: int):
        self.n, self.seed, self.salt = n, seed, salt
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def permutation(self, epoch: int) -> np.ndarray:
        with self._lock:
            p = self._perms.get(epoch)
            if p is None:
                p = self._perms[epoch] = _rng(self.seed, self.salt, epoch).permutation(self.n)
                while len(self._perms) > 2:
                    self._perms.popitem(last=False)
            self._perms.move_to_end(epoch)
            return p

    def ordinals(self, g0: int, count: int) -> np.ndarray:
        """Units of global positions [g0, g0 + count)."""
        g = np.arange(g0, g0 + count, dtype=np.int64)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(g // self.n).tolist():
            sel = g // self.n == e
            out[sel] = self.permutation(e)[g[sel] % self.n]
        return out

    def in_epochs(self, epochs: float) -> int:
        """Units in the first `epochs` epochs (a fraction counts that share of an epoch's units)."""
        whole = int(epochs)
        return whole * self.n + int((epochs - whole) * self.n)


class BlockCache:
    """Decoded blocks by index, the least recently used dropped once they hold more than `max_bytes`
    (the last one read always stays)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self._bytes = 0

    def get(self, b: int, load: Callable[[], tuple[Any, int]]) -> Any:
        """Block `b`, from the cache or `load()` (which returns the block and its size in bytes)."""
        hit = self._items.get(b)
        if hit is not None:
            self._items.move_to_end(b)
            return hit[0]
        value, size = load()
        self._items[b] = (value, size)
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, (_, n) = self._items.popitem(last=False)
            self._bytes -= n
        return value
