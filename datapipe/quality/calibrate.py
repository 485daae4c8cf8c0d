"""The `calibrate` stage of a build: the threshold of each `classifier` filter with `keep_top`, computed once
per (source, filter) before the scan, so that every scan task of the source uses the same one.

The calibration sample is the first `calibration_docs` (default 10,000) documents of the source, in input
order, that reach the filter: read, normalised, and passed by the steps before it in the source's chain
(language ID, redaction, the earlier filters). Per model key, with n sample documents scored, the
threshold is the score of the ceil(keep_top * n)-th best of them; `score >= threshold` keeps at least that
share of the sample (more only on tied scores). A model that no sample document reaches keeps its own cut
(fastText 0.5, a head its training threshold's). The result: WORK/calibration/SOURCE.INDEX.json (the
thresholds and the sample sizes), which the manifest's `quality` repeats.
"""
from __future__ import annotations

import json
import math
import os

from datatrove.pipeline.base import PipelineStep

from datapipe.workfiles import calibration_path
from storage import atomic


def calibration_jobs(cfg) -> list[tuple[str, int]]:
    """(source, filter index) of every classifier filter with keep_top, in config order."""
    return [(s.name, i) for s in cfg.sources for i, spec in enumerate(cfg.filters_for(s))
            if spec.type == "classifier" and spec.params.get("keep_top") is not None]


def top_threshold(scores: list[float], keep_top: float) -> float:
    """The score of the ceil(keep_top * n)-th best of `scores` (n >= 1)."""
    k = max(1, math.ceil(keep_top * len(scores) - 1e-9))
    return sorted(scores, reverse=True)[k - 1]


class Calibrate(PipelineStep):
    """Task k: job k of `calibration_jobs`; `reread` are the reader and normaliser (no rejects)."""

    name = "🎯 classifier calibration"
    type = "🔻 - FILTER"

    def __init__(self, cfg, files, reread: list[PipelineStep], work: str):
        super().__init__()
        self.cfg, self.files, self.reread, self.work = cfg, files, reread, work
        self.jobs = calibration_jobs(cfg)

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        from datapipe.quality.qfilter import ClassifierFilter, default_threshold
        from datapipe.steps import PerSourceFilters

        source, index = self.jobs[rank]
        src = next(s for s in self.cfg.sources if s.name == source)
        chain = PerSourceFilters(self.cfg, self.files, None, None)._chain(src)
        pos = next(k for k, (label, _) in enumerate(chain) if label == f"{index}_classifier")
        prefix, clf = [step for _, step in chain[:pos]], chain[pos][1]
        assert isinstance(clf, ClassifierFilter)
        limit = clf.params.calibration_docs
        texts: dict[str, list[str]] = {route: [] for route in clf.params.routes}
        n, F = 0, len(self.files)
        for r in (r for r, f in enumerate(self.files) if f.source == source):
            docs = None
            for step in [*self.reread, *prefix]:
                docs = step.run(docs, r, F)
            for doc in docs:
                route = clf.route(doc)
                if route is not None:
                    texts[route].append(doc.text)
                n += 1
                if n >= limit:
                    break
            docs.close()
            if n >= limit:
                break
        thresholds, sizes = {}, {}
        for route, batch in texts.items():
            scorer = clf.scorer(route)
            scores = [s for start in range(0, len(batch), clf.params.batch_size)
                      for s in scorer.score(batch[start:start + clf.params.batch_size])]
            sizes[route] = len(scores)
            thresholds[route] = (top_threshold(scores, clf.params.keep_top) if scores
                                 else default_threshold(clf.params.routes[route]))
            self.stat_update("calibration_documents", value=len(scores))
        out = {"source": source, "filter": f"{index}_classifier", "keep_top": clf.params.keep_top,
               "calibration_docs": limit, "documents_read": n, "sample_documents": sizes, "thresholds": thresholds}
        os.makedirs(os.path.dirname(calibration_path(self.work, source, index)), exist_ok=True)
        atomic.write_bytes(calibration_path(self.work, source, index), (json.dumps(out, indent=1) + "\n").encode())
