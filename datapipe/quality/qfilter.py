"""The `classifier` filter of a build's filter chains: scores each document with a quality model (a fastText
`.bin` or an embedding-head folder), stores the score as `quality_score` in its metadata, and drops the
documents below the threshold (reason `classifier_below_threshold`).

Params: `model` (one model for every document) or `models: {language: path}` (documents routed by their
`code_language` or `language` metadata; the key `default` takes the other languages; a document whose
language has no model and no `default` is kept unscored and counted as `quality_unscored`); `label` (the
fastText label whose probability is the score, default `hq`); `threshold` (keep score >= threshold) or
`keep_top` (a share in (0, 1]: the threshold is the score of the ceil(keep_top * n)-th best of the first
`calibration_docs` documents of the source that reach the filter, per model: see datapipe.quality.calibrate);
neither: the model's own cut (fastText 0.5, a head its training threshold's); `newline_replacement` (what
a newline becomes before fastText reads a text, default " "; datatrove's default is "").

fastText scores equal datatrove's `FastTextClassifierFilter` (same preprocessing, same `predict(k=-1)`
probabilities), computed a batch at a time in one call into fastText. Counts per task: a histogram of the
scores (`quality_score:<filter>:<model key>:<bin>`, BINS fixed bins over the model's score range) and the
kept documents (`quality_kept:...`), gathered into the manifest's `quality` per source.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass

from datatrove.pipeline.filters.base_filter import BaseFilter

from storage.config import ConfigError

BINS = 20
REASON = "classifier_below_threshold"
PARAMS = ("model", "models", "label", "threshold", "keep_top", "calibration_docs", "newline_replacement", "batch_size")
DEFAULT_ROUTE = "default"


@dataclass
class ClassifierParams:
    routes: dict[str, str]  # language (or `default`) → model path
    label: str = "hq"
    threshold: float | None = None
    keep_top: float | None = None
    calibration_docs: int = 10_000
    newline_replacement: str = " "
    batch_size: int = 256


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_params(params: dict, where: str) -> ClassifierParams:
    """The filter's params, checked for names, types and ranges (not the model files: `check_params`)."""
    key = f"key '{where}.params"
    for k in params:
        if k not in PARAMS:
            raise ConfigError(f"{key}.{k}': unknown parameter for filter 'classifier' (known: {', '.join(PARAMS)})")
    if ("model" in params) == ("models" in params):
        raise ConfigError(f"{key}': give model (a local model file or head folder) or models ({{language: path}}), "
                          "exactly one")
    if "model" in params:
        if not isinstance(params["model"], str) or not params["model"]:
            raise ConfigError(f"{key}.model': must be a local path, got {params['model']!r}")
        routes = {DEFAULT_ROUTE: params["model"]}
    else:
        routes = params["models"]
        if not isinstance(routes, dict) or not routes:
            raise ConfigError(f"{key}.models': must map languages (or default) to local paths, got {routes!r}")
        for lang, path in routes.items():
            if not isinstance(path, str) or not path:
                raise ConfigError(f"{key}.models.{lang}': must be a local path, got {path!r}")
        routes = {str(k): v for k, v in routes.items()}
    p = ClassifierParams(routes)
    if "label" in params:
        if not isinstance(params["label"], str) or not params["label"].strip():
            raise ConfigError(f"{key}.label': must be a label name such as hq, got {params['label']!r}")
        p.label = params["label"].removeprefix("__label__")
    if "threshold" in params and "keep_top" in params:
        raise ConfigError(f"{key}': give threshold or keep_top, not both")
    if "threshold" in params:
        if not _number(params["threshold"]):
            raise ConfigError(f"{key}.threshold': must be a number, got {params['threshold']!r}")
        p.threshold = float(params["threshold"])
    if "keep_top" in params:
        v = params["keep_top"]
        if not _number(v) or not 0 < v <= 1:
            raise ConfigError(f"{key}.keep_top': must be a share in (0, 1], got {v!r}")
        p.keep_top = float(v)
    for k in ("calibration_docs", "batch_size"):
        if k in params:
            v = params[k]
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{key}.{k}': must be an integer >= 1, got {v!r}")
            setattr(p, k, v)
    if "newline_replacement" in params:
        v = params["newline_replacement"]
        if not isinstance(v, str) or "\n" in v:
            raise ConfigError(f"{key}.newline_replacement': must be a string without a newline, got {v!r}")
        p.newline_replacement = v
    return p


def route_key(where: str, params: dict, route: str) -> str:
    return f"{where}.params.model" if "model" in params else f"{where}.params.models.{route}"


def model_range(path: str) -> tuple[float, float]:
    """A model's score range without loading it: fastText [0, 1], a head its recorded range."""
    if os.path.isdir(path):
        from datapipe.quality.embedding import read_head_meta

        lo, hi = read_head_meta(path)["score_range"]
        return float(lo), float(hi)
    return 0.0, 1.0


def default_threshold(path: str) -> float:
    if os.path.isdir(path):
        from datapipe.quality.embedding import read_head_meta

        return float(read_head_meta(path)["cut"])
    return 0.5


_SCORERS: dict[tuple, object] = {}


def scorer_for(path: str, label: str, newline_replacement: str = " "):
    """The loaded model of `path` (once per process)."""
    key = (os.path.abspath(path), label, newline_replacement)
    if key not in _SCORERS:
        from datapipe.quality.embedding import HeadScorer
        from datapipe.quality.fasttext_clf import FastTextScorer

        _SCORERS[key] = HeadScorer(path, threads=1) if os.path.isdir(path) else FastTextScorer(path, label, newline_replacement)
    return _SCORERS[key]


def check_params(params: dict, where: str) -> ClassifierParams:
    """Everything a build can check before it starts: params, model files, labels, threshold range. Each
    error is one line naming the key and the model file."""
    from datapipe.quality.embedding import HeadError, check_encoder, read_head_meta

    p = parse_params(params, where)
    for route, path in p.routes.items():
        key = route_key(where, params, route)
        if os.path.isdir(path):
            try:
                check_encoder(read_head_meta(path), path)
            except HeadError as e:
                raise ConfigError(f"key '{key}': {e}") from None
        elif not os.path.isfile(path):
            raise ConfigError(f"key '{key}': model file {path!r} not found (a local fastText .bin or an "
                              "embedding-head folder from `datapipe classifier train`; datapipe never downloads "
                              "models)")
        else:
            try:
                labels = scorer_for(path, p.label, p.newline_replacement).labels
            except (ValueError, RuntimeError, MemoryError) as e:
                raise ConfigError(f"key '{key}': {path!r} is not a fastText model ({e})") from None
            if p.label not in labels:
                raise ConfigError(f"key '{where}.params.label': {p.label!r} is not a label of model {path} "
                                  f"(its labels: {', '.join(sorted(labels))})")
        lo, hi = model_range(path)
        if p.threshold is not None and not lo <= p.threshold <= hi:
            raise ConfigError(f"key '{where}.params.threshold': {p.threshold:g} is outside the score range "
                              f"[{lo:g}, {hi:g}] of model {path}")
    return p


def score_bin(score: float, lo: float, hi: float) -> int:
    return min(max(int((score - lo) / (hi - lo) * BINS), 0), BINS - 1) if hi > lo else 0


class ClassifierFilter(BaseFilter):
    """Filter `label` (e.g. `2_classifier`) of a chain; see the module's docstring."""

    name = "🤖 quality classifier"

    def __init__(self, params: dict, label: str, calibration: str | None = None, exclusion_writer=None):
        p = parse_params(params, label)
        super().__init__(exclusion_writer, batch_size=p.batch_size)
        self.params, self.label, self.calibration = p, label, calibration
        self._thresholds: dict[str, float] | None = None

    def __getstate__(self):  # workers load the models themselves
        return {**self.__dict__, "_thresholds": None}

    def route(self, doc) -> str | None:
        """The model key of a document: its language's, else `default`, else None (not scored)."""
        meta = doc.metadata
        lang = meta.get("code_language") or meta.get("language")
        if lang in self.params.routes:
            return lang
        return DEFAULT_ROUTE if DEFAULT_ROUTE in self.params.routes else None

    def scorer(self, route: str):
        return scorer_for(self.params.routes[route], self.params.label, self.params.newline_replacement)

    def thresholds(self) -> dict[str, float]:
        if self._thresholds is None:
            self._thresholds = resolve_thresholds(self.params, self.calibration)
        return self._thresholds

    def filter(self, doc):
        return self.filter_batch([doc])[0]

    def filter_batch(self, batch):
        groups: dict[str | None, list[int]] = {}
        for i, doc in enumerate(batch):
            groups.setdefault(self.route(doc), []).append(i)
        results: list = [True] * len(batch)
        counts: Counter = Counter()
        thresholds = self.thresholds()
        for route, idx in groups.items():
            if route is None:
                counts[f"quality_unscored:{self.label}"] += len(idx)
                continue
            scorer, t = self.scorer(route), thresholds[route]
            lo, hi = scorer.score_range
            kept = 0
            for i, s in zip(idx, scorer.score([batch[i].text for i in idx])):
                doc = batch[i]
                doc.metadata["quality_score"] = s
                counts[f"quality_score:{self.label}:{route}:{score_bin(s, lo, hi):02d}"] += 1
                if s < t:
                    results[i] = (False, REASON)
                elif not doc.text.strip():  # as datatrove's filter: nothing left to keep
                    results[i] = (False, "empty")
                else:
                    kept += 1
            counts[f"quality_kept:{self.label}:{route}"] += kept
        for k, v in counts.items():
            self.stat_update(k, value=v)
        return results


def resolve_thresholds(p: ClassifierParams, calibration: str | None) -> dict[str, float]:
    """Model key → the threshold in use: `threshold`, the calibrated one (`keep_top`), or the model's cut."""
    if p.threshold is not None:
        return dict.fromkeys(p.routes, p.threshold)
    if p.keep_top is not None:
        if calibration is None or not os.path.exists(calibration):
            raise RuntimeError(f"keep_top: the calibration file {calibration} is missing (the calibrate stage "
                               "writes it before the scan)")
        with open(calibration, encoding="utf-8") as f:
            return {k: float(v) for k, v in json.load(f)["thresholds"].items()}
    return {route: default_threshold(path) for route, path in p.routes.items()}


def quality_summary(params: dict, label: str, stats: dict[str, int], calibration: str | None) -> dict:
    """A filter's entry of the manifest's `quality`: models, thresholds, the histogram per model key (BINS
    bins over its score range, all scored documents), kept and unscored counts. Pops its keys from `stats`."""
    p = parse_params(params, label)
    thresholds = resolve_thresholds(p, calibration)
    out = {"models": dict(p.routes), "label": p.label, "keep_top": p.keep_top, "thresholds": thresholds,
           "bins": BINS, "ranges": {}, "histograms": {}, "kept": {}, "unscored": 0}
    if calibration and os.path.exists(calibration):
        with open(calibration, encoding="utf-8") as f:
            out["calibration_documents"] = json.load(f)["sample_documents"]
    for route, path in p.routes.items():
        out["ranges"][route] = list(model_range(path))
        hist = [stats.pop(f"quality_score:{label}:{route}:{b:02d}", 0) for b in range(BINS)]
        out["histograms"][route] = hist
        out["kept"][route] = stats.pop(f"quality_kept:{label}:{route}", 0)
    out["unscored"] = stats.pop(f"quality_unscored:{label}", 0)
    return out
