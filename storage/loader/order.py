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
        self._epoch = functools.lru_cache(maxsize=4)(self._epoch_uncached)
        self._window = functools.lru_cache(maxsize=64)(self._window_uncached)

    def _epoch_uncached(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        perm = _rng(self.seed, self._key, 0, e).permutation(len(self.block_tokens))
        return perm, np.cumsum(self.block_tokens[perm])

    def _window_uncached(self, e: int, w: int) -> np.ndarray:
        size = min(self.window, self.n_seq - w * self.window)
        return _rng(self.seed, self._key, 1, e, w).permutation(size)

    def position(self, k: int) -> tuple[int, int]:
        """(epoch, sequence index within the epoch's stream) of the k-th sequence drawn."""
        e, j = divmod(int(k), self.n_seq)
        w, o = divmod(j, self.window)
        return e, w * self.window + int(self._window(e, w)[o])

    def pieces(self, k: int) -> list[Piece]:
        """Where the k-th sequence's seq_len + 1 tokens lie: consecutive (block, start, stop) slices."""
        e, q = self.position(k)
        perm, ends = self._epoch(e)
        t0 = q * self.seq_len
        t1 = t0 + self.seq_len + 1
        i = int(np.searchsorted(ends, t0, side="right"))
        out: list[Piece] = []
        while t0 < t1:
            b = int(perm[i])
            bstart = int(ends[i]) - int(self.block_tokens[b])
            stop = min(t1, int(ends[i]))
            out.append((b, t0 - bstart, stop - bstart))
            t0 = stop
            i += 1
        return out
