"""Per-source sequence order: which tokens the k-th sequence drawn from a source holds.

Epoch e of a source is the concatenation of its blocks in a permutation seeded by (seed, source, e).
That stream is cut every `seq_len` tokens into sequences of `seq_len + 1` tokens (Megatron-style: the
last token of one sequence is the first of the next, so no token is lost as a label); the tail shorter
than that is dropped. Sequences are then shuffled within windows of `window` sequences, so a long
document is spread over many batches. A source that runs out starts epoch e + 1 with a new permutation.
Everything is a pure function of (block token counts, seq_len, seed, window): no rank or worker count.
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np

Piece = tuple[int, int, int]  # (block number within the source, first token, stop token)


def _rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(w) for w in words])))


def distinct_values(a: np.ndarray) -> np.ndarray:
    """np.unique(a), with a shortcut for the usual case of planning: all equal (one source, one epoch)."""
    if len(a) and (a == a[0]).all():
        return a[:1]
    return np.unique(a)


def source_key(name: str) -> int:
    """A stable integer for a source name (Python's hash() is salted per process)."""
    return zlib.crc32(name.encode())


@dataclass
class SourceOrder:
    name: str
    block_tokens: np.ndarray  # tokens of each block, in the source's flat block numbering
    seq_len: int
    seed: int
    window: int

    def __post_init__(self) -> None:
        self.block_tokens = np.asarray(self.block_tokens, dtype=np.int64)
        total = int(self.block_tokens.sum())
        self.n_seq = (total - 1) // self.seq_len if total > 0 else 0
        if self.n_seq < 1:
            raise ValueError(f"source {self.name!r} has {total} tokens, fewer than one sequence of "
                             f"{self.seq_len + 1}")
        self._key = source_key(self.name)
        self._epoch = functools.lru_cache(maxsize=2)(self._epoch_uncached)  # ~16 bytes per block each
        self._window = functools.lru_cache(maxsize=64)(self._window_uncached)
        self._slots = functools.lru_cache(maxsize=3)(self._slots_uncached)  # epochs e and e + 1

    def _epoch_uncached(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        perm = _rng(self.seed, self._key, 0, e).permutation(len(self.block_tokens))
        return perm, np.cumsum(self.block_tokens[perm])

    def _window_uncached(self, e: int, w: int) -> np.ndarray:
        size = min(self.window, self.n_seq - w * self.window)
        return _rng(self.seed, self._key, 1, e, w).permutation(size)

    def _slots_uncached(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Per block, in epoch e: (the first sequence slot of the window holding its first sequence, n_seq if
        none does; the last slot of the window holding its last sequence). Every use of the block in epoch
        e is drawn between the two."""
        perm, ends = self._epoch(e)
        q_first = np.maximum(ends - self.block_tokens[perm] - 1, 0) // self.seq_len
        first = np.where(q_first < self.n_seq, q_first // self.window * self.window, self.n_seq)
        q_last = np.minimum((ends - 1) // self.seq_len, self.n_seq - 1)
        last = np.minimum((q_last // self.window + 1) * self.window, self.n_seq) - 1
        out = np.empty((2, len(perm)), dtype=np.int64)
        out[:, perm] = first, last
        return out[0], out[1]

    def done_with(self, b: int, k: int, horizon: float = 0) -> bool:
        """Whether a reader that has drawn every cursor up to k needs block b within the next `horizon`
        cursors: not if the block's first window this epoch starts further ahead than that, or if its
        last one has been drawn and its first window of the next epoch starts further ahead."""
        e, j = divmod(int(k), self.n_seq)
        first, last = self._slots(e)
        if first[b] > j:
            return int(first[b]) - j > horizon
        if last[b] > j:
            return False
        return self.n_seq - j + int(self._slots(e + 1)[0][b]) > horizon

    def position(self, k: int) -> tuple[int, int]:
        """(epoch, sequence index within the epoch's stream) of the k-th sequence drawn."""
        e, j = divmod(int(k), self.n_seq)
        w, o = divmod(j, self.window)
        return e, w * self.window + int(self._window(e, w)[o])

    def _in_window(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, window, position within the window before the shuffle) of cursors ks, vectorized."""
        e, j = np.divmod(ks, self.n_seq)
        w, o = np.divmod(j, self.window)
        pair = e * (self.n_seq // self.window + 2) + w
        windows = distinct_values(pair)
        if len(windows) == 1:
            return e, w, self._window(int(e[0]), int(w[0]))[o]
        pos = np.empty_like(ks)
        for pv in windows:
            m = pair == pv
            pos[m] = self._window(int(e[m][0]), int(w[m][0]))[o[m]]
        return e, w, pos

    def part_of(self, ks: np.ndarray, parts: int) -> np.ndarray:
        """Which of `parts` contiguous stretches of its shuffle window each sequence (cursor) comes from.
        Worker processes split every batch this way, so each reads about 1/parts of a window's blocks."""
        _, w, pos = self._in_window(np.asarray(ks, dtype=np.int64))
        return pos * parts // np.minimum(self.window, self.n_seq - w * self.window)

    def locate(self, ks: np.ndarray) -> tuple[np.ndarray, ...]:
        """Where sequences ks (cursors) lie, vectorized: arrays (which, block, start, stop, dst) with one
        entry per block slice; `which` indexes ks, `dst` is the slice's offset within its row."""
        ks = np.asarray(ks, dtype=np.int64)
        e, w, pos = self._in_window(ks)
        t0 = (w * self.window + pos) * self.seq_len
        t1 = t0 + self.seq_len + 1
        parts = []
        for ee in distinct_values(e):
            idx = np.flatnonzero(e == ee)
            perm, ends = self._epoch(int(ee))
            i0 = np.searchsorted(ends, t0[idx], side="right")
            i1 = np.searchsorted(ends, t1[idx] - 1, side="right")
            cnt = i1 - i0 + 1
            first = np.repeat(np.cumsum(cnt) - cnt, cnt)
            i = np.repeat(i0, cnt) + np.arange(int(cnt.sum())) - first
            which = np.repeat(idx, cnt)
            b = perm[i]
            bend = ends[i]
            bstart = bend - self.block_tokens[b]
            lo = np.maximum(t0[which], bstart)
            hi = np.minimum(t1[which], bend)
            parts.append((which, b, lo - bstart, hi - bstart, lo - t0[which]))
        return tuple(np.concatenate(x) for x in zip(*parts))

    def pieces(self, k: int) -> list[Piece]:
        """Where the k-th sequence's seq_len + 1 tokens lie: consecutive (block, start, stop) slices."""
        _, b, a, z, _ = self.locate(np.array([k]))
        return list(zip(b.tolist(), a.tolist(), z.tolist()))
