"""Partitioned near-dup clustering (datapipe.dedup.clusters): the same clusters, removals and report as a
plain union-find, for any number of parts and rounds, converged or finished by the fallback."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from datapipe.dedup.clusters import CCEdges, CCFinish, CCStep, ClusterKeep, near_removals, write_report
from datapipe.workfiles import atomic_json, atomic_npy

RANKS, DOCS = 5, 400


def _graph(seed: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Pairs of (rank, doc): a 120-node path in shuffled order (long diameter), stars, cliques across
    ranks, random sparse edges, repeats."""
    rng = random.Random(seed)
    nodes = [(r, d) for r in range(RANKS) for d in range(DOCS)]
    rng.shuffle(nodes)
    path, rest = nodes[:120], nodes[120:]
    pairs = list(zip(path, path[1:]))
    for k in range(10):
        centre, leaves = rest[k * 12], rest[k * 12 + 1:k * 12 + 12]
        pairs += [(leaf, centre) for leaf in leaves]
    clique = rest[130:138]
    pairs += [(a, b) for a in clique for b in clique if a < b]
    for _ in range(300):
        pairs.append((rng.choice(rest[140:900]), rng.choice(rest[140:900])))
    pairs += pairs[:40]  # a pair found in two bands
    return pairs


def _reference(pairs, exact: set) -> tuple[list[list[tuple[int, int]]], dict[int, list[int]]]:
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[find(a)] = find(b)
    comps: dict = {}
    for x in list(parent):
        comps.setdefault(find(x), []).append(x)
    clusters = sorted(sorted(m for m in c if m not in exact) for c in comps.values())
    clusters = [c for c in clusters if len(c) > 1]
    removes: dict[int, list[int]] = {}
    for c in clusters:
        for r, d in c[1:]:
            removes.setdefault(r, []).append(d)
    return clusters, {r: sorted(d) for r, d in removes.items()}


def _run(tmp, pairs, exact: set, parts: int, rounds: int):
    work, pairs_dir = tmp / "work", tmp / "pairs"
    pairs_dir.mkdir(parents=True)
    rec = np.array([[a[0], a[1], b[0], b[1]] for a, b in pairs], dtype="<u4")
    for i, chunk in enumerate(np.array_split(rec, 7)):  # as the verify stage: several .dups files
        chunk.tofile(pairs_dir / f"{i:05d}_00.dups")
    for r in range(RANKS):
        atomic_json(str(work / "ids" / f"{r:05d}.json"), [f"r{r}/d{d}" for d in range(DOCS)])
        atomic_npy(str(work / "exact" / "000" / f"{r:05d}.npy"),
                   np.array(sorted(d for rr, d in exact if rr == r), dtype=np.uint32))
    cc, remove = str(work / "cc"), str(work / "remove")
    for p in range(parts):
        CCEdges(str(pairs_dir), cc, RANKS).run(rank=p, world_size=parts)
    for k in range(1, 2 * rounds + 1):
        for p in range(parts):
            CCStep(cc, k, RANKS).run(rank=p, world_size=parts)
    CCFinish(cc, 2 * rounds, RANKS, parts).run()
    for p in range(parts):
        ClusterKeep(cc, remove, str(work), 1).run(rank=p, world_size=parts)
    write_report(cc, parts, str(tmp / "report.jsonl"))
    final = json.loads((work / "cc" / "final.json").read_text())
    removes = {r: near_removals(remove, r).tolist() for r in range(RANKS)}
    return final, {r: d for r, d in removes.items() if d}, (tmp / "report.jsonl").read_text()


@pytest.mark.parametrize("parts,rounds", [(1, 1), (3, 2), (4, 8)])
def test_same_clusters_as_union_find_for_any_parts_and_rounds(tmp_path, parts, rounds):
    pairs = _graph(seed=parts)
    rng = random.Random(7)
    exact = set(rng.sample(sorted({n for p in pairs for n in p}), 60))
    final, removes, report = _run(tmp_path, pairs, exact, parts, rounds)
    clusters, want = _reference(pairs, exact)
    assert removes == want
    lines = [json.loads(x) for x in report.splitlines()]
    assert lines == [{"kept": f"r{c[0][0]}/d{c[0][1]}", "removed": [f"r{r}/d{d}" for r, d in c[1:]]}
                     for c in clusters]
    # the 120-node path needs more than 2 rounds: the fallback finished it; 8 rounds converge
    assert final["converged"] == (rounds == 8), final


def test_owner_parts_hold_only_their_ranks(tmp_path):
    pairs = _graph(seed=11)
    _run(tmp_path, pairs, set(), 3, 8)
    cc = tmp_path / "work" / "cc" / "16"
    for f in sorted(cc.glob("*-*.npy")):
        e = np.load(f)
        q = int(f.stem.split("-")[1])
        ranks = (e[:, 0] >> np.uint64(32)).astype(int)
        assert all(r * 3 // RANKS == q for r in ranks.tolist())
    centres = json.loads((tmp_path / "work" / "cc" / "final.json").read_text())
    assert centres == {"step": 16, "converged": True}
