"""MinHash near-dedup on datatrove's four stages, with a faster signature step and priority-aware keeps.

- `minhash_config` maps our settings (n-grams, bands × rows, hash width) onto datatrove's MinhashConfig.
- `FastMinhashSignature` is datatrove's `MinhashDedupSignature` with only the shingling replaced: our
  `FastWordTokenizer` instead of spaCy's word split, and xxhash called directly on the joined n-grams.
  The signature itself (the per-document minimum over the permuted shingle hashes) and the file writing
  are datatrove's own code, unchanged. Wherever the two word splits agree it writes the same signature
  files; tests/datapipe/test_datapipe_minhash.py and tools/bench/bench_dedup.py compare whole runs of both
  steps, document for document.
- datatrove's cluster stage keeps an arbitrary member of each cluster (union by size);
  `resolve_clusters` writes our own `.remove` files so the member first in priority order is kept, and
  writes the clusters (ids) to a JSONL report.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import xxhash
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
from datatrove.utils.hashing import HashConfig

from datapipe.config import MinhashSettings
from datapipe.dedup.simplify import simplify_text
from datapipe.dedup.exact import exact_removals, lookup_ids
from datapipe.wordtok import tokenize_words
from storage.fs import atomic_write_bytes

_MERSENNE = np.uint64((1 << 61) - 1)


def minhash_config(s: MinhashSettings) -> MinhashConfig:
    return MinhashConfig(n_grams=s.n_grams, num_buckets=s.bands, hashes_per_bucket=s.rows, seed=s.seed,
                         hash_config=HashConfig(precision=s.hash_bits, hash_fc=s.hash_fc))


class FastMinhashSignature(MinhashDedupSignature):
    """`MinhashDedupSignature(language="en")` with faster shingling: the same signature files wherever our
    word split equals spaCy's."""

    name = "🎯 MinHash stage 1 (fast)"

    def get_shingles(self, text: str) -> np.ndarray:
        words = tokenize_words(simplify_text(text, self.config.norm_config))
        n = self.config.n_grams
        if len(words) < n:
            return np.zeros((0, 1), dtype=np.uint64)
        if self.config.hash_config.hash_fc == "xxhash":
            h = xxhash.xxh64_intdigest if self.config.hash_config.precision == 64 else xxhash.xxh32_intdigest
        else:
            h = self._hash_func
        joined = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
        return np.fromiter(map(h, joined), dtype=np.uint64, count=len(joined)).reshape((-1, 1))


def resolve_clusters(cluster_dir: str, remove_dir: str, n_ranks: int, work: str, exact_parts: int,
                     report_path: str) -> int:
    """Keep, per near-duplicate cluster, the member first in (rank, index) order among those that are not
    exact duplicates (removed as such; their kept copy is in the same cluster, so the choice is the same);
    write `remove_dir/{rank:06d}.remove` (sorted post-filter indices) and a JSONL cluster report.
    Memory: the clustered documents only (datatrove's cluster stage writes just those). Returns the number
    of documents to remove."""
    members: dict[int, list[tuple[int, int]]] = {}
    for r in range(n_ranks):
        path = os.path.join(cluster_dir, f"{r:06d}.clusters")
        if not os.path.exists(path):
            continue
        exact = set(exact_removals(os.path.join(work, "exact"), r, exact_parts).tolist())
        pairs = np.fromfile(path, dtype="<u4").reshape(-1, 2)
        for doc, cid in pairs.tolist():
            if doc not in exact:
                members.setdefault(cid, []).append((r, doc))
    clusters = sorted(sorted(m) for m in members.values() if len(m) > 1)
    removes: dict[int, list[int]] = {r: [] for r in range(n_ranks)}
    for mem in clusters:
        for r, d in mem[1:]:
            removes[r].append(d)
    total = 0
    for r, docs in removes.items():
        docs.sort()
        total += len(docs)
        atomic_write_bytes(os.path.join(remove_dir, f"{r:06d}.remove"), struct.pack(f"<{len(docs)}I", *docs))
    ids = lookup_ids(work, [m for mem in clusters for m in mem])
    lines = [json.dumps({"kept": ids[m[0]], "removed": [ids[x] for x in m[1:]]}) + "\n" for m in clusters]
    atomic_write_bytes(report_path, "".join(lines).encode())
    return total
