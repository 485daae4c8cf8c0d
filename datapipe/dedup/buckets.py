"""datatrove's MinHash bucket stage on numpy arrays: the same `.dups` files, byte for byte, without a
Python heap step per signature record.

`MinhashDedupBuckets` merges the band's sorted signature files of every task with a heap and writes, for
each record whose band signature equals the previous record's, the pair (previous file, previous doc,
file, doc) as four uint32. `FastMinhashBuckets` memory-maps those files, finds the task's hash range in
each by binary search, and handles it in sub-ranges of at most `max_records` records (cut at quantiles
of the first hash, so equal signatures never straddle a cut): concatenate, `lexsort` by (signature,
file, doc), the heap's order, and write the pairs of equal neighbours. Memory is one sub-range.
Index folders (dedup against an earlier dataset) and remote folders fall back to datatrove's code.
"""
from __future__ import annotations

import os

import numpy as np
from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets
from fsspec.implementations.local import LocalFileSystem


class FastMinhashBuckets(MinhashDedupBuckets):
    name = "🎯 MinHash stage 2 (fast)"

    def __init__(self, input_folder, output_folder, config=None, max_records: int = 1 << 22):
        super().__init__(input_folder, output_folder, config=config)
        self.max_records = max_records

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        if self.index_folder is not None or not isinstance(self.input_folder.fs, LocalFileSystem):
            return super().run(data, rank, world_size)
        cfg = self.config
        assert world_size % cfg.num_buckets == 0, "Number of tasks must be divisible by num_buckets"
        workers = world_size // cfg.num_buckets
        bucket, worker = divmod(rank, workers)
        rows = cfg.hashes_per_bucket
        rec = np.dtype([(f"h{i}", f"<{cfg.hash_config.struct_format}") for i in range(rows)] + [("doc", "<u4")])
        with self.track_time():
            names = self.input_folder.list_files(subdirectory=f"bucket_{bucket:03d}")
            lo, hi = self.get_worker_hash_range(names, rank, world_size)
            sigs = [_records(os.path.join(self.input_folder.path, n), rec) for n in names]
            stems = np.array([int(os.path.basename(n).removesuffix(".minhash.sig")) for n in names], dtype=np.uint32)
            spans = [(np.searchsorted(s["h0"], lo), np.searchsorted(s["h0"], hi)) for s in sigs]
            total = sum(int(e - b) for b, e in spans)
            cuts = [lo, hi]
            if total > self.max_records:
                sample = np.sort(np.concatenate([s["h0"][np.linspace(b, e - 1, 64).astype(np.int64)]
                                                 for s, (b, e) in zip(sigs, spans) if e > b]))
                inner = sample[np.linspace(0, len(sample) - 1, -(-total // self.max_records) + 1)[1:-1].astype(np.int64)]
                cuts = [lo, *np.unique(inner).tolist(), hi]
            with self.output_folder.open(f"{bucket:05d}_{worker:02d}.dups", mode="wb") as out:
                for a, b in zip(cuts, cuts[1:]):
                    out.write(self._pairs(sigs, stems, a, b, rows).tobytes())

    def _pairs(self, sigs: list[np.ndarray], stems: np.ndarray, lo, hi, rows: int) -> np.ndarray:
        parts = [s[np.searchsorted(s["h0"], lo):np.searchsorted(s["h0"], hi)] for s in sigs]
        r = np.concatenate(parts) if parts else np.zeros(0)
        if len(r) < 2:
            return np.zeros((0, 4), dtype="<u4")
        file = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
        order = np.lexsort([r["doc"], file] + [r[f"h{i}"] for i in reversed(range(rows))])
        r, file = r[order], file[order]
        same = np.ones(len(r) - 1, dtype=bool)
        for i in range(rows):
            same &= r[f"h{i}"][1:] == r[f"h{i}"][:-1]
        cur = np.flatnonzero(same) + 1
        self.stat_update("total_matches", value=len(cur))
        return np.stack([stems[file[cur - 1]], r["doc"][cur - 1], stems[file[cur]], r["doc"][cur]], axis=1).astype("<u4")


def _records(path: str, rec: np.dtype) -> np.ndarray:
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=rec)
    return np.memmap(path, dtype=rec, mode="r")
