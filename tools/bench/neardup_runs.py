"""The near-duplicate set's two dedup methods (tools/bench/neardup_cjk.py builds the set): our build's
stages (signatures with the segmenters, buckets, verify, clusters) and datatrove's four MinHash stages, run on
the same documents; and the quality of a clustering (recall per Jaccard range, precision, traps merged).
Used by tools/bench/bench_multilingual.py and tests/datapipe/test_datapipe_multilingual.py."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings (bench_neardup) when imported by a test
from neardup_cjk import jaccard  # noqa: E402


def _docs(texts, langs, idx, with_meta: bool):
    from datatrove.data import Document

    return [Document(text=texts[i], id=str(i), metadata={"language": langs[i]} if with_meta else {}) for i in idx]


def run_dedup(texts: list[str], langs: list[str], idx: list[int], tmp: str, ours: bool, dt_lang: str = "en") -> dict:
    """All stages of one method on the documents `idx` (4 input tasks) → seconds, cluster of each document."""
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )

    from bench_neardup import our_clusters, read_clusters
    from datapipe.config import MinhashSettings
    from datapipe.dedup.buckets import FastMinhashBuckets
    from datapipe.dedup.minhash import FastMinhashSignature, minhash_config
    from datapipe.dedup.verify import MinhashVerify

    n, tasks_n = len(idx), 4
    step = -(-n // tasks_n)
    tasks = [range(r * step, min(n, (r + 1) * step)) for r in range(tasks_n)]
    docs = _docs(texts, langs, idx, ours)
    settings = MinhashSettings()
    cfg = minhash_config(settings) if ours else MinhashConfig()
    t0 = time.perf_counter()
    for rank, t in enumerate(tasks):
        sig = (FastMinhashSignature(f"{tmp}/sigs", cfg, sketch_folder=f"{tmp}/sketches") if ours
               else MinhashDedupSignature(f"{tmp}/sigs", config=cfg, language=dt_lang))
        sig.run(iter([docs[i] for i in t]), rank=rank, world_size=tasks_n)
    buckets = FastMinhashBuckets if ours else MinhashDedupBuckets
    for band in range(cfg.num_buckets):
        buckets(f"{tmp}/sigs", f"{tmp}/buckets", config=cfg).run(rank=band, world_size=cfg.num_buckets)
    if ours:
        verify = MinhashVerify(f"{tmp}/buckets", f"{tmp}/sketches", f"{tmp}/verified", settings.verify_threshold)
        for band in range(cfg.num_buckets):
            verify.run(rank=band, world_size=cfg.num_buckets)
        _, cluster = our_clusters(f"{tmp}/verified", f"{tmp}/cc", tasks)
    else:
        MinhashDedupCluster(f"{tmp}/buckets", f"{tmp}/clusters", config=cfg, save_cluster_id=True).run()
        for rank, t in enumerate(tasks):
            for _ in MinhashDedupFilter(f"{tmp}/clusters").run(iter([docs[i] for i in t]), rank=rank):
                pass
        cluster = read_clusters(f"{tmp}/clusters", tasks)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "cluster": {idx[d]: c for d, c in cluster.items()}}


def quality(cluster: dict[int, int], pairs, traps, sets, langs) -> dict:
    out = {}
    members: dict[int, list[int]] = {}
    for d, c in cluster.items():
        members.setdefault(c, []).append(d)
    for lang in sorted(set(langs)):
        ps = [(i, j, jv) for i, j, jv, lg in pairs if lg == lang]
        rec = {}
        for label, lo, hi in (("[0.50,0.75)", 0.5, 0.75), ("[0.75,0.85)", 0.75, 0.85), ("[0.85,1]", 0.85, 2),
                              (">= 0.75", 0.75, 2), (">= 0.85", 0.85, 2)):
            inb = [(i, j) for i, j, jv in ps if lo <= jv < hi]
            rec[label] = (sum(i in cluster and cluster.get(i) == cluster.get(j) for i, j in inb), len(inb))
        removed = [d for ms in members.values() for d in sorted(ms)[1:] if langs[d] == lang]
        nearest = [max(jaccard(sets[d], sets[o]) for o in members[cluster[d]] if o != d) for d in removed]
        tr = [(a, b) for a, b in traps if langs[a] == lang]
        out[lang] = {"recall": rec, "removed": len(removed),
                     "precision": sum(x >= 0.5 for x in nearest) / max(1, len(removed)),
                     "traps_merged": (sum(a in cluster and cluster.get(a) == cluster.get(b) for a, b in tr), len(tr))}
    return out
