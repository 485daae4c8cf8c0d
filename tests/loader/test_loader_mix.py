"""Mixing: per-phase proportions, low discrepancy, phase boundaries, and the data that comes out."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from storage.loader.blend import PERIOD, Blend, greedy_table, quotas
from storage.manifest import Phase

SOURCES = ["web", "code", "math"]


def test_phase_proportions_within_one_percent_over_10k():
    seq_len = 100
    phases = [Phase("p1", {"web": 0.7, "code": 0.2, "math": 0.1}, 10_000 * seq_len),
              Phase("p2", {"web": 0.2, "code": 0.3, "math": 0.5}, 10_000 * seq_len),
              Phase("p3", {"code": 1.0, "math": 3.0}, 1)]
    b = Blend(SOURCES, seq_len)
    b.add_segment(0, phases)
    src, cur = b.assign_at(np.arange(30_000))
    for i, ph in enumerate(phases):
        got = np.bincount(src[i * 10_000:(i + 1) * 10_000], minlength=3) / 10_000
        want = np.array([ph.weights.get(s, 0.0) for s in SOURCES])
        want /= want.sum()
        assert np.abs(got - want).max() < 0.01, (ph.name, got, want)
    for s in range(3):  # each source's draws are 0, 1, 2, ... across phases
        assert np.array_equal(cur[src == s], np.arange((src == s).sum()))


def test_greedy_assignment_is_low_discrepancy():
    w = {"web": 0.55, "code": 0.3, "math": 0.15}
    q = quotas(w, SOURCES)
    assert sum(q) == PERIOD
    src, _, _ = greedy_table(q)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[src[:5000]], axis=0)
    target = np.outer(np.arange(1, 5001), np.array(q) / PERIOD)
    # a random draw would drift by ~sqrt(n); the Megatron-style greedy stays within one sequence
    assert np.abs(counts - target).max() < 1.0


def test_random_access_matches_sequential_assignment():
    b = Blend(SOURCES, 10)
    b.add_segment(0, [Phase("x", {"web": 1, "code": 2}, 777), Phase("y", {"math": 1, "web": 1}, 5)])
    src, cur = b.assign_at(np.arange(PERIOD + 500))
    for g in (0, 77, 78, PERIOD - 1, PERIOD + 123):
        s1, k1 = b.assign_at(np.array([g]))
        assert (s1[0], k1[0]) == (src[g], cur[g])
        assert b.cursors(g)[src[g]] == cur[g]


def test_tiny_weight_still_gets_sequences():
    q = quotas({"web": 1.0, "code": 1e-9}, SOURCES)
    assert q[1] >= 1 and q[2] == 0


def test_loaded_rows_follow_the_weights(tmp_path, ld, loader_factory):
    root = str(tmp_path / "ds")
    mix = [Phase("p", {"web": 0.6, "code": 0.3, "math": 0.1}, 10**9)]
    ld.make_dataset(root, {"web": 200, "code": 150, "math": 100}, mix=mix)
    loader = loader_factory(root, G=50)
    src = np.concatenate([ld.source_of_rows(b) for b in ld.take(loader, 20)])
    assert np.array_equal(src, loader.assignments(0, 1000)[0])
    share = np.bincount(src, minlength=3) / len(src)
    assert np.abs(share - [0.6, 0.3, 0.1]).max() < 0.01


def test_source_is_repeated_with_a_new_epoch_order(tmp_path, ld, loader_factory):
    root = str(tmp_path / "ds")
    mix = [Phase("p", {"web": 0.5, "code": 0.5}, 10**9)]
    ld.make_dataset(root, {"web": 200, "code": 20}, mix=mix)  # code runs out several times
    loader = loader_factory(root, G=32, shuffle_window=8)
    n_code = loader.orders[1].n_seq
    rows = [r for b in ld.take(loader, 2 * (2 * n_code) // 32 + 2) for r in b.numpy()]
    code_rows = [r for r in rows if r.max() // ld.SPAN == 1]
    assert len(code_rows) >= 2 * n_code
    ep0, ep1 = code_rows[:n_code], code_rows[n_code:2 * n_code]
    assert len({r.tobytes() for r in ep0}) == len({r.tobytes() for r in ep1}) == n_code  # no repeats inside
    assert [r.tobytes() for r in ep0] != [r.tobytes() for r in ep1]  # the next epoch has another order ...
    # ... over the same tokens: each epoch's rows (less the overlap token) cover the source but its tail
    c0, c1 = (Counter(np.concatenate([r[:-1] for r in ep]).tolist()) for ep in (ep0, ep1))
    assert sum(((c0 - c1) + (c1 - c0)).values()) <= 2 * 32


@pytest.mark.parametrize("bad", [{"nope": 1.0}, {"web": -1.0}])
def test_bad_mix_is_rejected(mixed_ds, loader_factory, bad):
    with pytest.raises(ValueError):
        loader_factory(mixed_ds, mix=[Phase("x", bad, 100)])
