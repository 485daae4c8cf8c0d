"""Mixing: which source global sequence g comes from, and that source's cursor (its k-th draw).

Within a phase, sources follow Megatron's blended-dataset rule: sequence i goes to the source whose
realized count lags its target `weight * (i + 1)` most (ties: the earlier source). Weights are quantized
to integer quotas over a period of 2**16 sequences; with integer quotas the greedy rule returns to zero
error after each period, so one table of 65,536 entries answers any g in O(1) and cursors never need a
replay from step 0. Phases have fixed lengths in tokens, hence fixed global-sequence boundaries; the last
phase runs on forever.

A `Blend` is a chain of segments. A segment starts at global sequence `start` with per-source cursors
`base` and follows one phase schedule. Changing the schedule at resume appends a segment whose base is
the cursors reached so far, so consumed sequences are neither repeated nor skipped.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from storage.manifest import Phase

PERIOD = 1 << 16


def quotas(weights: dict[str, float], sources: list[str]) -> tuple[int, ...]:
    """Integer shares of PERIOD per source (largest remainder; every positive weight gets >= 1)."""
    w = np.array([max(0.0, float(weights.get(s, 0.0))) for s in sources])
    if w.sum() <= 0:
        raise ValueError(f"phase weights {weights} give no source a positive weight")
    exact = w / w.sum() * PERIOD
    q = np.floor(exact).astype(np.int64)
    q[(w > 0) & (q == 0)] = 1
    rest = PERIOD - int(q.sum())
    order = np.argsort(-(exact - q), kind="stable")
    i = 0
    while rest != 0:
        s = order[i % len(order)]
        if rest > 0 and w[s] > 0:
            q[s] += 1
            rest -= 1
        elif rest < 0 and q[s] > 1:
            q[s] -= 1
            rest += 1
        i += 1
    return tuple(int(x) for x in q)


@functools.lru_cache(maxsize=16)
def greedy_table(q: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source of each position in the period, rank of that position among its source's, prefix counts).

    prefix[r] holds per-source counts over positions [0, r) at r = 0, 1024, 2048, ...: a coarse table
    that `counts` completes with a short bincount."""
    err = [0] * len(q)  # PERIOD * (target - realized), exact in integers
    src = np.empty(PERIOD, dtype=np.int32)
    for i in range(PERIOD):
        err = [e + x for e, x in zip(err, q)]
        s = err.index(max(err))
        err[s] -= PERIOD
        src[i] = s
    rank = np.empty(PERIOD, dtype=np.int64)
    seen = np.zeros(len(q), dtype=np.int64)
    for s in range(len(q)):
        pos = np.flatnonzero(src == s)
        rank[pos] = np.arange(len(pos))
        seen[s] = len(pos)
    assert tuple(seen) == q, "greedy blend table does not meet its quotas"
    return src, rank, q


def _counts(q: tuple[int, ...], n: int) -> np.ndarray:
    src, _, _ = greedy_table(q)
    full, r = divmod(int(n), PERIOD)
    return np.asarray(q, dtype=np.int64) * full + np.bincount(src[:r], minlength=len(q))


def phase_sequences(ph: Phase, seq_len: int) -> int:
    return -(-int(ph.tokens) // seq_len)


def mix_fingerprint(phases: list[Phase]) -> str:
    plain = [[p.name, sorted((k, float(v)) for k, v in p.weights.items()), int(p.tokens)] for p in phases]
    return hashlib.sha256(json.dumps(plain).encode()).hexdigest()[:16]


@dataclass
class _Run:
    """A stretch [start, stop) of global sequences under one phase of one segment."""
    start: int
    stop: int | None
    q: tuple[int, ...]
    base: np.ndarray  # per-source cursors at `start`


class Blend:
    def __init__(self, sources: list[str], seq_len: int):
        self.sources, self.seq_len = list(sources), seq_len
        self.segments: list[tuple[int, list[Phase], np.ndarray]] = []
        self._runs: list[_Run] = []

    def add_segment(self, start: int, phases: list[Phase], base: np.ndarray | None = None) -> None:
        """Follow `phases` (boundaries counted from global sequence 0) from global sequence `start` on."""
        if self.segments and start < self.segments[-1][0]:
            raise ValueError("segments must start in order")
        if base is None:
            base = self.cursors(start) if self.segments else np.zeros(len(self.sources), dtype=np.int64)
        self.segments = [s for s in self.segments if s[0] < start] + [(start, list(phases), np.asarray(base))]
        self._build_runs()

    def _build_runs(self) -> None:
        runs: list[_Run] = []
        for n, (seg_start, phases, base) in enumerate(self.segments):
            seg_stop = self.segments[n + 1][0] if n + 1 < len(self.segments) else None
            cur = np.array(base, dtype=np.int64)
            p_start = 0
            for i, ph in enumerate(phases):
                last = i == len(phases) - 1
                p_stop = None if last else p_start + phase_sequences(ph, self.seq_len)
                lo = max(p_start, seg_start)
                hi = p_stop if seg_stop is None else (seg_stop if p_stop is None else min(p_stop, seg_stop))
                if hi is None or lo < hi:
                    q = quotas(ph.weights, self.sources)
                    runs.append(_Run(lo, hi, q, cur.copy()))
                    if hi is not None:
                        cur = cur + _counts(q, hi - lo)
                p_start = p_stop if p_stop is not None else p_start
                if p_stop is None or (seg_stop is not None and p_stop >= seg_stop):
                    break
        self._runs = runs
        self._starts = np.array([r.start for r in runs], dtype=np.int64)

    def _run(self, g: int) -> _Run:
        i = int(np.searchsorted(self._starts, g, side="right")) - 1
        if i < 0:
            raise ValueError(f"global sequence {g} precedes the first segment")
        return self._runs[i]

    def cursors(self, g: int) -> np.ndarray:
        """Sequences drawn from each source over global sequences [segment start, g) plus the base."""
        run = self._run(g)
        return run.base + _counts(run.q, g - run.start)

    def assign_at(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, source cursor) of each global sequence in `g`, vectorized."""
        g = np.asarray(g, dtype=np.int64)
        src, cur = np.empty(len(g), dtype=np.int32), np.empty(len(g), dtype=np.int64)
        if not len(g):
            return src, cur
        which = np.searchsorted(self._starts, g, side="right") - 1
        lo, hi = int(which.min()), int(which.max())
        if lo < 0:
            raise ValueError(f"global sequence {int(g.min())} precedes the first segment")
        for i in range(lo, hi + 1):  # runs are contiguous: searchsorted on their starts finds each g's
            m = slice(None) if lo == hi else which == i
            run = self._runs[i]
            src_t, rank_t, q = greedy_table(run.q)
            full, r = np.divmod(g[m] - run.start, PERIOD)
            s = src_t[r]
            src[m] = s
            cur[m] = run.base[s] + full * np.asarray(q, dtype=np.int64)[s] + rank_t[r]
        return src, cur

    def state(self) -> list[dict]:
        return [{"start": int(st), "mix": [{"name": p.name, "weights": dict(p.weights), "tokens": int(p.tokens)}
                                           for p in ph], "base": [int(x) for x in base]}
                for st, ph, base in self.segments]

    @classmethod
    def from_state(cls, sources: list[str], seq_len: int, segments: list[dict]) -> Blend:
        b = cls(sources, seq_len)
        for seg in segments:
            phases = [Phase(p["name"], dict(p["weights"]), int(p["tokens"])) for p in seg["mix"]]
            b.add_segment(int(seg["start"]), phases, np.asarray(seg["base"], dtype=np.int64))
        return b
