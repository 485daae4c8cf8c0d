"""Exact dedup: hash each kept document's normalised text, keep the first occurrence in priority order.

Priority order is the build's global document order (source order in the config, then file, then line),
so a document shared by two sources is kept in the higher-priority one. Hashes are written per task;
one global pass decides removals and writes the duplicate clusters (ids) for auditing.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from datapipe.workfiles import atomic_json, atomic_npy, load_npy


def text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class ExactHasher(PipelineStep):
    """Passes documents through, recording (hash, id) of each in `folder/{rank}.npy|.ids.json`."""

    name = "#️⃣ exact hash"
    type = "🫂 - DEDUP"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        hashes, ids = [], []
        for doc in data:
            hashes.append(text_hash(doc.text))
            ids.append(doc.id)
            yield doc
        atomic_json(os.path.join(self.folder, f"{rank:05d}.ids.json"), ids)
        atomic_npy(os.path.join(self.folder, f"{rank:05d}.npy"), np.asarray(hashes, dtype=np.uint64))


def find_exact_duplicates(hash_dir: str, out_dir: str, n_ranks: int, report_path: str) -> int:
    """Write `out_dir/{rank}.remove.npy` (sorted indices to drop) and a JSONL report of clusters
    (`kept` id and `removed` ids); return the number of documents removed."""
    per_rank = [load_npy(os.path.join(hash_dir, f"{r:05d}.npy"), np.uint64) for r in range(n_ranks)]
    sizes = [len(h) for h in per_rank]
    all_h = np.concatenate(per_rank) if per_rank else np.zeros(0, np.uint64)
    rank_of = np.repeat(np.arange(n_ranks), sizes)
    idx_of = np.concatenate([np.arange(n) for n in sizes]) if sizes else np.zeros(0, np.int64)
    order = np.argsort(all_h, kind="stable")  # stable: equal hashes stay in priority order
    sorted_h = all_h[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = sorted_h[1:] != sorted_h[:-1]
    dup_pos = order[~first]
    removed = 0
    for r in range(n_ranks):
        rm = np.sort(idx_of[dup_pos][rank_of[dup_pos] == r]).astype(np.uint32)
        removed += len(rm)
        atomic_npy(os.path.join(out_dir, f"{r:05d}.remove.npy"), rm)
    ids_cache: dict[int, list[str]] = {}

    def doc_id(pos: int) -> str:
        r = int(rank_of[pos])
        if r not in ids_cache:
            with open(os.path.join(hash_dir, f"{r:05d}.ids.json")) as f:
                ids_cache[r] = json.load(f)
        return ids_cache[r][int(idx_of[pos])]

    lines = []
    group_start = np.flatnonzero(first)
    group_end = np.append(group_start[1:], len(order))
    for a, b in zip(group_start, group_end):
        if b - a > 1:
            lines.append(json.dumps({"kept": doc_id(order[a]), "removed": [doc_id(p) for p in order[a + 1:b]]}))
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    atomic_text(report_path, "".join(line + "\n" for line in lines))
    return removed


def atomic_text(path: str, text: str) -> None:
    from storage.fs import atomic_write_bytes

    atomic_write_bytes(path, text.encode())


class IndexRemover(PipelineStep):
    """Drops the documents whose stream index is listed in `folder/{rank}.remove.npy`; they go to the
    exclusion writer with `reason`."""

    type = "🫂 - DEDUP"

    def __init__(self, folder: str, label: str, reason: str, exclusion_writer=None):
        super().__init__()
        self.folder, self.label, self.reason = folder, label, reason
        self.exclusion_writer = exclusion_writer
        self.name = f"✂️ {label}"

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        path = os.path.join(self.folder, f"{rank:05d}.remove.npy")
        remove = set(load_npy(path, np.uint32).tolist()) if os.path.exists(path) else set()
        with self.exclusion_writer as rej:
            for i, doc in enumerate(data):
                self.stat_update("total")
                if i in remove:
                    self.stat_update("dropped")
                    doc.metadata.update(filter=self.label, filter_reason=self.reason)
                    rej.write(doc, rank)
                    continue
                self.stat_update("forwarded")
                yield doc
