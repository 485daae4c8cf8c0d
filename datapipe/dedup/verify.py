"""Verified MinHash candidates: a small per-document sketch, written by the signature step, and a stage
that keeps only the candidate pairs whose estimated Jaccard reaches `dedup.minhash.verify_threshold`,
between datatrove's bucket and cluster stages. No document text is needed at verify time.

Sketch (`{rank:05d}.sketch.npy`, uint8, `SKETCH_BINS` = 256 bytes per document, one row per document in
the task's stream order, memory-mapped when read): one-permutation hashing (Li, Owen & Zhang 2012) with
b-bit minima (Li & König 2010). The document's shingle hashes, mixed by a seeded splitmix64, fall into
256 bins by their top 8 bits; a bin stores 1 + (low 16 bits of its minimum) mod 255, or 0 when empty.
For two documents, a bin non-empty in both holds equal minima exactly when the minimum of the union's
shingles in that bin lies in the intersection; otherwise the codes agree by chance with probability
c = 1/255. With n_u bins non-empty in either, n_b in both and n_eq equal non-empty codes, the estimate
is J = (n_eq - c n_b) / (1 - c) / n_u. Each non-empty bin is one draw from the union (stratified, without
replacement), so the standard error is at most about sqrt((J(1-J) + c) / n_u) (`standard_error`), and
the estimate is near exact for documents with fewer shingles than bins.

Verify stage (`MinhashVerify`, one task per `.dups` file, i.e. per band): the bucket stage writes, for
each run of documents with equal band signatures, the chain of consecutive pairs in priority order.
Checking only that chain would lose a true pair separated by an unrelated member (shared boilerplate),
so each run is rebuilt from the chain and every member is checked against the run's first `anchors` (64)
members: every pair, for runs of up to 65. Pairs at or above the threshold are united (a union-find
forest in numpy arrays), anchors in rank order, so in a run of copies a pair already united is not
checked again; each resulting set is written as a star from its first member, in datatrove's `.dups`
format, for `MinhashDedupCluster`. Index matches (datatrove's SENTINEL) pass through unchecked. Memory:
the band file's pairs and one batch of sketch rows. Stats: candidate_pairs (read), pairs_checked,
pairs_below_threshold, candidate_pairs_dropped (read pairs whose documents end up apart), pairs_written.
"""
from __future__ import annotations

import os

import numpy as np
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import SENTINEL

from storage import atomic

SKETCH_BINS = 256
_CODES = 255  # non-empty codes 1..255; 0 marks an empty bin
_CHANCE = 1.0 / _CODES
_CHUNK = 1 << 15  # pairs estimated per numpy batch (2 x 8 MiB of sketch rows)
_LOW32 = np.uint64(0xFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sketches(docs: list[np.ndarray], seed: int = 1) -> np.ndarray:
    """The sketches (len(docs) x 256 uint8) of documents given by their shingle hashes (uint64 arrays)."""
    n = len(docs)
    lens = np.fromiter(map(np.size, docs), dtype=np.int64, count=n)
    if not lens.sum():
        return np.zeros((n, SKETCH_BINS), dtype=np.uint8)
    z = _splitmix64(np.concatenate([d.reshape(-1) for d in docs]) ^ np.uint64(seed))
    cell = np.repeat(np.arange(n) * SKETCH_BINS, lens) + (z >> np.uint64(56)).astype(np.int64)
    mins = np.full(n * SKETCH_BINS, np.iinfo(np.uint64).max, dtype=np.uint64)
    np.minimum.at(mins, cell, z)
    out = (1 + (mins & np.uint64(0xFFFF)) % np.uint64(_CODES)).astype(np.uint8)
    out[np.bincount(cell, minlength=n * SKETCH_BINS) == 0] = 0
    return out.reshape(n, SKETCH_BINS)


def sketch(shingles: np.ndarray, seed: int = 1) -> np.ndarray:
    """The 256-byte sketch of one document from its shingle hashes."""
    return sketches([shingles], seed)[0]


def estimate_jaccard(sa: np.ndarray, sb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Jaccard estimates of row pairs of sketches, and n_u (bins non-empty in either) for their error."""
    ea, eb = sa != 0, sb != 0
    n_union = np.count_nonzero(ea | eb, axis=-1)
    n_both = np.count_nonzero(ea & eb, axis=-1)
    n_eq = np.count_nonzero((sa == sb) & ea, axis=-1)
    matches = (n_eq - _CHANCE * n_both) / (1.0 - _CHANCE)
    return np.clip(matches / np.maximum(n_union, 1), 0.0, 1.0), n_union


def standard_error(j, n_union):
    """An upper estimate of the standard error of `estimate_jaccard` at true Jaccard j."""
    return np.sqrt((j * (1.0 - j) + _CHANCE) / np.maximum(n_union, 1))


class SketchWriter:
    """Appends one task's sketches (one per document, in stream order) and commits
    `folder/{rank:05d}.sketch.npy` atomically on `close`; memory is one batch of documents."""

    def __init__(self, folder: str, rank: int, seed: int):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"{rank:05d}.sketch.npy")
        self.raw = atomic.tmp_path(self.path + ".raw")  # the sketches, until their count (the header) is known
        atomic.clear_stale(self.raw)
        self.f = open(self.raw, "wb")
        self.seed, self.n = seed, 0

    def add(self, docs: list[np.ndarray]) -> None:
        """Sketch and append the next documents, given by their shingle hashes."""
        if docs:
            self.f.write(sketches(docs, self.seed).tobytes())
            self.n += len(docs)

    def close(self) -> None:
        self.f.close()
        try:
            with atomic.atomic_file(self.path) as out, open(self.raw, "rb") as raw:
                np.lib.format.write_array_header_1_0(
                    out, {"descr": "|u1", "fortran_order": False, "shape": (self.n, SKETCH_BINS)})
                while chunk := raw.read(1 << 24):
                    out.write(chunk)
        finally:
            os.unlink(self.raw)


class SketchReader:
    """Rows of every task's sketch file, addressed by (file << 32 | doc) keys; files memory-mapped."""

    def __init__(self, folder: str):
        self.folder, self.maps = folder, {}

    def rows(self, keys: np.ndarray) -> np.ndarray:
        files = (keys >> np.uint64(32)).astype(np.int64)
        docs = (keys & _LOW32).astype(np.int64)
        out = np.empty((len(keys), SKETCH_BINS), dtype=np.uint8)
        order = np.argsort(files, kind="stable")
        for seg in np.split(order, np.flatnonzero(np.diff(files[order])) + 1):
            if len(seg):
                out[seg] = self._map(int(files[seg[0]]))[docs[seg]]
        return out

    def _map(self, rank: int) -> np.ndarray:
        if rank not in self.maps:
            self.maps[rank] = np.load(os.path.join(self.folder, f"{rank:05d}.sketch.npy"), mmap_mode="r")
        return self.maps[rank]


def _ragged_arange(counts: np.ndarray) -> np.ndarray:
    """concat(arange(c) for c in counts), vectorized."""
    ends = np.cumsum(counts)
    return np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - counts, counts)


def anchors(run_starts: np.ndarray, sizes: np.ndarray, limit: int) -> tuple[np.ndarray, ...]:
    """The first `limit` members of each run that have a later member: their positions, how many members
    follow each in its run, and their rank in the run; ordered by rank (every run's first member, then
    every run's second...). The pairs to check are (anchor, each later member of its run)."""
    n_anchor = np.minimum(sizes - 1, limit)
    local = _ragged_arange(n_anchor)
    order = np.argsort(local, kind="stable")
    return ((np.repeat(run_starts, n_anchor) + local)[order], (np.repeat(sizes, n_anchor) - 1 - local)[order],
            local[order])


def roots(label: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The set of each node of x in the union-find forest `label` (parents point to smaller nodes; a
    root is the smallest node of its set); the path of each queried node is shortened to its root."""
    r = label[x]
    while True:
        up = label[r]
        if np.array_equal(up, r):
            label[x] = r
            return r
        r = up


def join(label: np.ndarray, u: np.ndarray, v: np.ndarray) -> None:
    """Unite the sets of u[k] and v[k] for every k (roots hooked under the smaller root, in numpy)."""
    while len(u):
        ru, rv = roots(label, u), roots(label, v)
        differ = ru != rv
        u, v, ru, rv = u[differ], v[differ], ru[differ], rv[differ]
        np.minimum.at(label, np.maximum(ru, rv), np.minimum(ru, rv))


class MinhashVerify(PipelineStep):
    """Between `MinhashDedupBuckets` and `MinhashDedupCluster`: keeps the candidate pairs whose estimated
    Jaccard is >= `threshold` (see the module docstring); task `rank` handles every world_size-th
    `.dups` file of `input_folder` and writes its verified pairs under the same name in `output_folder`."""

    type = "🫂 - DEDUP"
    name = "🎯 MinHash verify"

    def __init__(self, input_folder: str, sketch_folder: str, output_folder: str, threshold: float,
                 anchors: int = 64):
        super().__init__()
        self.input_folder, self.sketch_folder, self.output_folder = input_folder, sketch_folder, output_folder
        self.threshold, self.anchors = threshold, anchors

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        names = sorted(f for f in os.listdir(self.input_folder) if f.endswith(".dups") and not atomic.is_tmp(f))
        reader = SketchReader(self.sketch_folder)
        with self.track_time():
            for name in names[rank::world_size]:
                pairs = np.fromfile(os.path.join(self.input_folder, name), dtype="<u4").reshape(-1, 4)
                atomic.write_bytes(os.path.join(self.output_folder, name), self.verify(pairs, reader).tobytes())

    def verify(self, pairs: np.ndarray, reader: SketchReader) -> np.ndarray:
        """The verified pairs (n x 4 uint32, datatrove's record layout) of one `.dups` file's pairs."""
        index = pairs[:, 0] == SENTINEL
        own = pairs[~index].astype(np.uint64)
        self.stat_update("candidate_pairs", value=len(own))
        if not len(own):
            return pairs[index]
        a, b = own[:, 0] << np.uint64(32) | own[:, 1], own[:, 2] << np.uint64(32) | own[:, 3]
        new_run = np.ones(len(a), dtype=bool)
        new_run[1:] = a[1:] != b[:-1]
        starts = np.flatnonzero(new_run)
        members = np.insert(b, starts, a[starts])  # each run: its first member, then its chain
        run_starts = starts + np.arange(len(starts))
        nodes, inv = np.unique(members, return_inverse=True)
        label = np.arange(len(nodes))
        anchor, later, rank = anchors(run_starts, np.diff(np.append(run_starts, len(members))), self.anchors)
        ends = np.cumsum(later)
        # pairs enumerated anchor by anchor, in batches that never span two anchor ranks: after the first
        # members' pairs, pairs already joined (a run of copies) are skipped, not checked
        firsts = np.flatnonzero(np.diff(rank, prepend=-1))
        cuts = np.union1d(np.arange(0, ends[-1], _CHUNK), (ends - later)[firsts]).tolist() + [int(ends[-1])]
        checked = below = 0
        for c, e in zip(cuts, cuts[1:]):
            k = np.arange(c, e)
            which = np.searchsorted(ends, k, side="right")
            u, v = inv[anchor[which]], inv[anchor[which] + 1 + k - (ends[which] - later[which])]
            open_ = roots(label, u) != roots(label, v)  # pairs already joined need no check
            u, v = u[open_], v[open_]
            est, _ = estimate_jaccard(reader.rows(nodes[u]), reader.rows(nodes[v]))
            ok = est >= self.threshold
            join(label, u[ok], v[ok])
            checked, below = checked + len(u), below + int(len(u) - ok.sum())
        label = roots(label, np.arange(len(nodes)))
        la, lb = label[np.searchsorted(nodes, a)], label[np.searchsorted(nodes, b)]
        star = np.flatnonzero(label != np.arange(len(nodes)))
        first, other = nodes[label[star]], nodes[star]
        out = np.stack([first >> np.uint64(32), first & _LOW32, other >> np.uint64(32), other & _LOW32], axis=1)
        self.stat_update("pairs_checked", value=checked)
        self.stat_update("pairs_below_threshold", value=below)
        self.stat_update("candidate_pairs_dropped", value=int((la != lb).sum()))
        self.stat_update("pairs_written", value=len(out))
        return np.concatenate([pairs[index], out.astype("<u4")])
