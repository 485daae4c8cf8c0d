"""Near-duplicate clusters with no single task: connected components of the verified candidate pairs by
alternating large-star and small-star rounds (Kiveris et al., "Connected Components in MapReduce and
Beyond", SoCC 2014), each step a stage of `dedup.minhash.cluster_parts` tasks.

A node is a document as the uint64 `(rank << 32) | post-filter index`, so node order is priority order and
a component's minimum is its first document in priority order. Task `p` owns the nodes of input ranks
`[p * ranks / parts, (p + 1) * ranks / parts)`; every step reads the edges of its nodes (both directions of
each undirected edge, from every task of the previous step: `cc/STEP/SRC-DST.npy`, uint64 pairs) and
writes the new edges to their owners:

- large-star: each node links its larger neighbours to the minimum of itself and its neighbours;
- small-star: each node with smaller neighbours links them and itself to the smallest of them.

When a large-star and the small-star after it change nothing, every component is a star around its
minimum (the theorem of the paper). Each task counts what it changed (`cc/STEP/SRC.json`). `CCFinish`
(one task) checks the last two steps; if `cluster_rounds` rounds were not enough it finishes the job with
a union-find over the remaining edges (a warning says so: then, and only then, one process holds every
clustered document). `ClusterKeep` (per part) takes each star whose centre it owns: members that are exact
duplicates are left to the exact stage (their kept copy has the same signatures, so it is in the same
cluster), the first remaining member is kept, the others go to `remove/PART/RANK.remove`, and the cluster
(ids) to a report part; `write_report` merges the parts in kept-document order, so the outputs are the
same for any number of parts and rounds.

Memory of a task: the edges of its nodes, about 50 bytes per directed edge while sorting. Rounds needed:
O(log n) on graphs such as candidate pairs (small diameter); a round is one pass over the edges.
"""
from __future__ import annotations

import heapq
import json
import os

import numpy as np
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import SENTINEL
from loguru import logger

from datapipe.dedup.exact import exact_removals, lookup_ids
from datapipe.workfiles import atomic_json, atomic_npy, read_json
from storage import atomic

_LOW32 = np.uint64(0xFFFFFFFF)
_EMPTY = np.zeros((0, 2), np.uint64)


def step_dir(cc_dir: str, step: int) -> str:
    return os.path.join(cc_dir, f"{step:02d}")


def owner(nodes: np.ndarray, n_ranks: int, parts: int) -> np.ndarray:
    """The part that owns each node: ranks split into `parts` contiguous ranges."""
    return ((nodes >> np.uint64(32)).astype(np.int64) * parts) // max(1, n_ranks)


def _write_edges(cc_dir: str, step: int, src: int, edges: np.ndarray, n_ranks: int, parts: int,
                 changed: int) -> None:
    """Both directions of each undirected edge, to the owner of its first node; then the task's counts."""
    both = np.concatenate([edges, edges[:, ::-1]]) if len(edges) else _EMPTY
    dst = owner(both[:, 0], n_ranks, parts)
    for q in range(parts):
        atomic_npy(os.path.join(step_dir(cc_dir, step), f"{src:05d}-{q:05d}.npy"), _unique(both[dst == q]))
    atomic_json(os.path.join(step_dir(cc_dir, step), f"{src:05d}.json"), {"changed": int(changed),
                                                                          "edges": int(len(edges))})


def _unique(e: np.ndarray) -> np.ndarray:
    """Rows sorted by (first, second) node, repeats dropped."""
    if len(e) < 2:
        return e
    e = e[np.lexsort([e[:, 1], e[:, 0]])]
    keep = np.ones(len(e), dtype=bool)
    keep[1:] = (e[1:, 0] != e[:-1, 0]) | (e[1:, 1] != e[:-1, 1])
    return e[keep]


def read_edges(cc_dir: str, step: int, part: int) -> np.ndarray:
    """The edges of `part`'s nodes written by every task of `step`, sorted, without repeats."""
    d = step_dir(cc_dir, step)
    names = sorted(n for n in (os.listdir(d) if os.path.isdir(d) else [])
                   if n.endswith(f"-{part:05d}.npy") and not atomic.is_tmp(n))
    found = [np.load(os.path.join(d, n), allow_pickle=False) for n in names]
    return _unique(np.concatenate(found)) if found else _EMPTY


def _groups(e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sorted edges: each row's group start (rows with the same first node) and the group starts."""
    starts = np.flatnonzero(np.r_[True, e[1:, 0] != e[:-1, 0]]) if len(e) else np.zeros(0, np.int64)
    return np.repeat(starts, np.diff(np.r_[starts, len(e)])), starts


def large_star(e: np.ndarray) -> tuple[np.ndarray, int]:
    """Each larger neighbour b of a node a is linked to m(a) = min(a, neighbours of a)."""
    row_start, _ = _groups(e)
    a, b = e[:, 0], e[:, 1]
    m = np.minimum(a, b[row_start])  # b is sorted within a group: its first row holds the minimum
    sel = b > a
    return np.stack([b[sel], m[sel]], axis=1), int(np.count_nonzero(sel & (m < a)))


def small_star(e: np.ndarray) -> tuple[np.ndarray, int]:
    """A node a with smaller neighbours links them and itself to the smallest of them."""
    row_start, starts = _groups(e)
    a, b = e[:, 0], e[:, 1]
    m = b[row_start]
    lower = b < a
    linked = lower & (b != m)
    centres = starts[b[starts] < a[starts]]  # groups with a smaller neighbour: (a, m) stays
    edges = np.concatenate([np.stack([b[linked], m[linked]], axis=1), np.stack([a[centres], b[centres]], axis=1)])
    return edges, int(np.count_nonzero(lower)) - len(centres)


class CCEdges(PipelineStep):
    """Task p: the candidate pair files `i` with i % parts == p, as node edges to their owners (step 0)."""

    name = "🧩 clusters: edges"

    def __init__(self, pairs_dir: str, cc_dir: str, n_ranks: int):
        super().__init__()
        self.pairs_dir, self.cc_dir, self.n_ranks = pairs_dir, cc_dir, n_ranks

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        names = sorted(n for n in os.listdir(self.pairs_dir)
                       if n.endswith(".dups") and not atomic.is_tmp(n))[rank::world_size]
        recs = [np.fromfile(os.path.join(self.pairs_dir, n), dtype="<u4").reshape(-1, 4) for n in names]
        r = np.concatenate(recs).astype(np.uint64) if recs else np.zeros((0, 4), np.uint64)
        r = r[(r[:, 0] != SENTINEL) & (r[:, 2] != SENTINEL)]  # index matches: none without an index
        edges = np.stack([(r[:, 0] << np.uint64(32)) | r[:, 1], (r[:, 2] << np.uint64(32)) | r[:, 3]], axis=1)
        edges = edges[edges[:, 0] != edges[:, 1]]
        self.stat_update("candidate_pairs", value=len(edges))
        _write_edges(self.cc_dir, 0, rank, edges, self.n_ranks, world_size, len(edges))


class CCStep(PipelineStep):
    """Step `step` (1, 2, ...): large-star on odd steps, small-star on even ones, over part `rank`'s nodes."""

    def __init__(self, cc_dir: str, step: int, n_ranks: int):
        super().__init__()
        self.cc_dir, self.step, self.n_ranks = cc_dir, step, n_ranks
        self.name = f"🧩 clusters: {'large' if step % 2 else 'small'}-star {step}"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        e = read_edges(self.cc_dir, self.step - 1, rank)
        new, changed = (large_star if self.step % 2 else small_star)(e)
        self.stat_update("changed", value=changed)
        _write_edges(self.cc_dir, self.step, rank, new, self.n_ranks, world_size, changed)


def changed(cc_dir: str, step: int, parts: int) -> int:
    return sum(read_json(os.path.join(step_dir(cc_dir, step), f"{p:05d}.json"))["changed"] for p in range(parts))


class CCFinish(PipelineStep):
    """One task after the last round: records which step holds the stars; if the last two steps still
    changed edges, finishes with a union-find over all remaining edges and writes the stars as one more
    step."""

    name = "🧩 clusters: converged?"

    def __init__(self, cc_dir: str, last: int, n_ranks: int, parts: int):
        super().__init__()
        self.cc_dir, self.last, self.n_ranks, self.parts = cc_dir, last, n_ranks, parts

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        cc, last, parts = self.cc_dir, self.last, self.parts
        if changed(cc, last - 1, parts) == 0 and changed(cc, last, parts) == 0:
            atomic_json(os.path.join(cc, "final.json"), {"step": last, "converged": True})
            return
        logger.warning(f"near-dup clusters: not converged after {last // 2} rounds "
                       "(dedup.minhash.cluster_rounds); finishing in one task")
        e = np.concatenate([read_edges(cc, last, p) for p in range(parts)])
        nodes, inv = np.unique(e, return_inverse=True)
        inv = inv.reshape(e.shape)
        label = np.arange(len(nodes))
        while True:  # min-label propagation with pointer jumping; labels index the sorted nodes
            prev = label.copy()
            np.minimum.at(label, inv[:, 0], label[inv[:, 1]])
            label = label[label]
            if np.array_equal(label, prev):
                break
        leaf = label != np.arange(len(nodes))
        stars = np.stack([nodes[leaf], nodes[label[leaf]]], axis=1)
        for src in range(parts):  # as if every part had written its share, so readers see one layout
            _write_edges(cc, last + 1, src, stars[owner(stars[:, 0], self.n_ranks, parts) == src], self.n_ranks,
                         parts, 0)
        atomic_json(os.path.join(cc, "final.json"), {"step": last + 1, "converged": False})
        self.stat_update("union_find_nodes", value=len(nodes))


class ClusterKeep(PipelineStep):
    """Part `rank`: the stars centred on its nodes → removals per input rank and a report part."""

    name = "🎯 near-dup clusters (priority keep)"

    def __init__(self, cc_dir: str, remove_dir: str, work: str, exact_parts: int):
        super().__init__()
        self.cc_dir, self.remove_dir, self.work, self.exact_parts = cc_dir, remove_dir, work, exact_parts

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        final = read_json(os.path.join(self.cc_dir, "final.json"))["step"]
        e = read_edges(self.cc_dir, final, rank)
        row_start, starts = _groups(e)
        a, b = e[:, 0], e[:, 1]
        is_centre = b[row_start] > a
        sizes = np.diff(np.r_[starts, len(e)])
        if np.any(~is_centre[starts] & (sizes != 1)):
            raise RuntimeError(f"near-dup clusters: part {rank} holds a node linked to two centres "
                               f"(step {final} is not a set of stars)")
        centre_rows = np.flatnonzero(is_centre)
        members = np.concatenate([a[starts[is_centre[starts]]], b[centre_rows]])
        cluster = np.concatenate([a[starts[is_centre[starts]]], a[centre_rows]])
        order = np.lexsort([members, cluster])  # clusters by centre, members in priority order
        members, cluster = members[order], cluster[order]
        ranks, docs = (members >> np.uint64(32)).astype(np.int64), (members & _LOW32).astype(np.uint32)
        exact = np.zeros(len(members), dtype=bool)
        for r in np.unique(ranks).tolist():
            sel = ranks == r
            exact[sel] = np.isin(docs[sel], exact_removals(os.path.join(self.work, "exact"), r, self.exact_parts))
        members, cluster, ranks, docs = members[~exact], cluster[~exact], ranks[~exact], docs[~exact]
        first = np.r_[True, cluster[1:] != cluster[:-1]] if len(cluster) else np.zeros(0, bool)
        size = np.diff(np.r_[np.flatnonzero(first), len(cluster)])
        big = np.repeat(size > 1, size)  # clusters that still have two members
        removed = big & ~first
        for r in np.unique(ranks[removed]).tolist():
            d = np.sort(docs[removed & (ranks == r)])
            atomic.write_bytes(os.path.join(self.remove_dir, f"{rank:03d}", f"{r:06d}.remove"),
                               d.astype("<u4").tobytes())
        self.stat_update("removed", value=int(removed.sum()))
        keep = np.flatnonzero(big & first)
        bounds = np.r_[np.flatnonzero(first), len(cluster)]
        ends = {s: e for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist())}
        wanted = [(int(ranks[i]), int(docs[i])) for i in np.flatnonzero(big).tolist()]
        ids = lookup_ids(self.work, wanted)
        rows = []
        for s in keep.tolist():
            names = [ids[(int(ranks[i]), int(docs[i]))] for i in range(s, ends[s])]
            rows.append((int(members[s]), json.dumps({"kept": names[0], "removed": names[1:]})))
        rows.sort()  # by the kept document: priority order
        atomic.write_bytes(os.path.join(self.cc_dir, "report", f"{rank:05d}.jsonl"),
                           "".join(f"{k}\t{line}\n" for k, line in rows).encode())


def near_removals(remove_dir: str | None, rank: int) -> np.ndarray:
    """Post-filter indices of `rank`'s near duplicates to drop (sorted), from every part's removals."""
    if not remove_dir or not os.path.isdir(remove_dir):
        return np.zeros(0, np.uint32)
    found = [np.fromfile(os.path.join(remove_dir, p, f"{rank:06d}.remove"), dtype="<u4")
             for p in sorted(os.listdir(remove_dir)) if os.path.exists(os.path.join(remove_dir, p, f"{rank:06d}.remove"))]
    return np.sort(np.concatenate(found)) if found else np.zeros(0, np.uint32)


def write_report(cc_dir: str, parts: int, path: str) -> None:
    """The dataset's `dedup/near_dup_clusters.jsonl`: the parts' clusters merged by kept document."""
    files = [open(os.path.join(cc_dir, "report", f"{p:05d}.jsonl"), encoding="utf-8") for p in range(parts)
             if os.path.exists(os.path.join(cc_dir, "report", f"{p:05d}.jsonl"))]
    try:
        rows = heapq.merge(*[((int(k), line) for k, line in (ln.split("\t", 1) for ln in f)) for f in files])
        atomic.write_bytes(path, "".join(line for _, line in rows).encode())
    finally:
        for f in files:
            f.close()
