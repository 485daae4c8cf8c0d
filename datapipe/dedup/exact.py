"""Exact dedup: hash each kept document's normalised text, keep the first occurrence in priority order.

Code (documents with a `code_language`) is hashed with its whitespace runs collapsed
(`datapipe.kinds.codetok.exact_key`), so reindented or re-wrapped copies of a file are one.
Priority order is the build's global document order (source order in the config, then file, then line),
so a document shared by two sources is kept in the higher-priority one. The scan tasks write their
hashes partitioned by hash value (`hashes/PART/RANK.npy`: hash, post-filter index); one task per
partition finds the duplicates of its hash range, so no process holds more than about 1/parts of the
corpus's hashes (16 bytes a document). Removals go to `exact/PART/RANK.npy`, the duplicate clusters
(ids) of each partition to `exact/report/PART.jsonl`, concatenated into the dataset's report at the end.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from datapipe.kinds.codetok import exact_key
from datapipe.workfiles import atomic_json, atomic_npy, load_npy
from storage import atomic


def text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def ids_path(work: str, rank: int) -> str:
    return os.path.join(work, "ids", f"{rank:05d}.json")


class ExactHasher(PipelineStep):
    """Passes documents through, recording each one's hash (by partition) and id."""

    name = "#️⃣ exact hash"
    type = "🫂 - DEDUP"

    def __init__(self, work: str, parts: int):
        super().__init__()
        self.work, self.parts = work, parts

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        hashes, ids = [], []
        for doc in data:
            hashes.append(text_hash(exact_key(doc.text) if "code_language" in doc.metadata else doc.text))
            ids.append(doc.id)
            yield doc
        atomic_json(ids_path(self.work, rank), ids)
        h = np.asarray(hashes, dtype=np.uint64)
        idx = np.arange(len(h), dtype=np.uint64)
        part = h % np.uint64(self.parts)
        for p in range(self.parts):
            sel = part == p
            atomic_npy(os.path.join(self.work, "hashes", f"{p:03d}", f"{rank:05d}.npy"),
                       np.stack([h[sel], idx[sel]], axis=1))


def find_exact_duplicates(work: str, part: int, n_ranks: int) -> int:
    """Duplicates among the hashes of partition `part`: writes the removals per rank and the part's
    cluster report; returns the number of documents removed."""
    per_rank = [load_npy(os.path.join(work, "hashes", f"{part:03d}", f"{r:05d}.npy"), np.uint64).reshape(-1, 2)
                for r in range(n_ranks)]
    rank_of = np.repeat(np.arange(n_ranks), [len(a) for a in per_rank])
    both = np.concatenate(per_rank) if per_rank else np.zeros((0, 2), np.uint64)
    hashes, idx_of = both[:, 0], both[:, 1]
    order = np.argsort(hashes, kind="stable")  # stable: equal hashes stay in priority order
    sorted_h = hashes[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = sorted_h[1:] != sorted_h[:-1]
    dup_pos = order[~first]
    for r in np.unique(rank_of[dup_pos]).tolist():
        rm = np.sort(idx_of[dup_pos][rank_of[dup_pos] == r]).astype(np.uint32)
        atomic_npy(os.path.join(work, "exact", f"{part:03d}", f"{r:05d}.npy"), rm)
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], len(order))
    groups = [order[a:b] for a, b in zip(starts, ends) if b - a > 1]
    ids = lookup_ids(work, [(int(rank_of[p]), int(idx_of[p])) for g in groups for p in g])
    lines = []
    for g in groups:
        names = [ids[(int(rank_of[p]), int(idx_of[p]))] for p in g]
        lines.append(json.dumps({"kept": names[0], "removed": names[1:]}) + "\n")
    atomic.write_bytes(os.path.join(work, "exact", "report", f"{part:03d}.jsonl"), "".join(lines).encode())
    return len(dup_pos)


def lookup_ids(work: str, wanted: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """Document ids of (rank, post-filter index) pairs, reading one rank's id list at a time."""
    out: dict[tuple[int, int], str] = {}
    by_rank: dict[int, list[int]] = {}
    for r, i in wanted:
        by_rank.setdefault(r, []).append(i)
    for r in sorted(by_rank):
        with open(ids_path(work, r)) as f:
            ids = json.load(f)
        for i in by_rank[r]:
            out[(r, i)] = ids[i]
    return out


def exact_removals(exact_dir: str, rank: int, parts: int) -> np.ndarray:
    """Sorted post-filter indices of `rank`'s exact duplicates (an empty array with exact dedup off)."""
    found = [load_npy(os.path.join(exact_dir, f"{p:03d}", f"{rank:05d}.npy"), np.uint32) for p in range(parts)]
    return np.sort(np.concatenate(found)) if found else np.zeros(0, np.uint32)


def write_report(work: str, parts: int, path: str) -> None:
    """The dataset's `dedup/exact_clusters.jsonl`: every partition's clusters, in partition order."""
    chunks = []
    for p in range(parts):
        part = os.path.join(work, "exact", "report", f"{p:03d}.jsonl")
        if os.path.exists(part):
            with open(part, "rb") as f:
                chunks.append(f.read())
    atomic.write_bytes(path, b"".join(chunks))


class ExactResolve(PipelineStep):
    """Task `rank` resolves exact duplicates in hash partition `rank`."""

    name = "#️⃣ exact dedup (partition)"

    def __init__(self, work: str, n_ranks: int):
        super().__init__()
        self.work, self.n_ranks = work, n_ranks

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        n = find_exact_duplicates(self.work, rank, self.n_ranks)
        self.stat_update("removed", value=n)
