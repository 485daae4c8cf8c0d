"""Training examples of a quality classifier, read from JSONL: `datapipe annotate`'s output (records with
`text` and `score`, a number or null when the reply had none: those are skipped and counted) or the user's
records of `text` + `score` (a number) or `text` + `label` (a string, one word: fastText's label token).

Scores become the two classes `hq` / `lq` at a threshold (`score >= threshold` is positive, FineWeb-Edu's
`int_score >= 3`) for fastText and the evaluation; the regression head learns the scores themselves. A bad
record is an error naming the file, its line and what is wrong.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

POSITIVE, NEGATIVE = "hq", "lq"


class LabelError(ValueError):
    """A training file that cannot be used; the one-line message names the file and line."""


@dataclass
class Examples:
    """Texts with a score each (`scores`) or a label each (`labels`), in file order."""
    texts: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    labels: list[str] | None = None
    skipped: dict[str, int] = field(default_factory=dict)  # reason → records not used

    def __len__(self) -> int:
        return len(self.texts)

    def classes(self, threshold: float, positive: str = POSITIVE) -> list[str]:
        """fastText's classes: the labels as given, or `positive` / `lq` by `score >= threshold`."""
        if self.labels is not None:
            return list(self.labels)
        return [positive if s >= threshold else NEGATIVE for s in self.scores]

    def is_positive(self, threshold: float, positive: str = POSITIVE) -> list[bool]:
        return [c == positive for c in self.classes(threshold, positive)]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_examples(paths: list[str]) -> Examples:
    """All usable records of `paths` (JSONL, optionally .gz). Every file must hold the same kind of record
    (scores or labels); records without text, or annotations without a score, are skipped and counted."""
    import gzip

    ex = Examples()
    kind = None  # "score" or "label", fixed by the first usable record
    first = ""
    for path in paths:
        try:
            f = gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")
        except FileNotFoundError:
            raise LabelError(f"{path}: no such file") from None
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {n}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise LabelError(f"{where}: not JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise LabelError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
                text = rec.get("text")
                if not isinstance(text, str):
                    raise LabelError(f"{where}: needs a string 'text', got {type(text).__name__}")
                has_score, has_label = "score" in rec, "label" in rec
                if has_score == has_label:
                    raise LabelError(f"{where}: needs exactly one of 'score' (a number) and 'label' (a string)")
                this = "score" if has_score else "label"
                if kind is None:
                    kind, first = this, where
                elif this != kind:
                    raise LabelError(f"{where}: has a {this!r} but {first} has a {kind!r} (one kind of record in all "
                                     "files)")
                value = rec[this]
                if this == "score":
                    if value is None:  # an annotation whose reply held no score
                        ex.skipped["no score"] = ex.skipped.get("no score", 0) + 1
                        continue
                    if not _number(value):
                        raise LabelError(f"{where}: 'score' must be a finite number or null, got {value!r}")
                elif not isinstance(value, str) or not value or value.split() != [value]:
                    raise LabelError(f"{where}: 'label' must be one word (fastText's label token), got {value!r}")
                if not text.strip():
                    ex.skipped["empty text"] = ex.skipped.get("empty text", 0) + 1
                    continue
                ex.texts.append(text)
                if this == "score":
                    ex.scores = (ex.scores or [])
                    ex.scores.append(float(value))
                else:
                    ex.labels = (ex.labels or [])
                    ex.labels.append(value)
    if not ex.texts:
        raise LabelError(f"{', '.join(paths)}: no usable record (skipped: "
                         f"{', '.join(f'{k} {v}' for k, v in ex.skipped.items()) or 'none'})")
    return ex


def check_two_classes(ex: Examples, threshold: float, positive: str, where: str) -> None:
    """Both the positive class and some other class must occur, or nothing can be learnt or evaluated."""
    classes = set(ex.classes(threshold, positive))
    if positive not in classes:
        what = f"no score >= {threshold:g}" if ex.labels is None else f"no record has label {positive!r}"
        raise LabelError(f"{where}: {what}, so there is no positive example (labels: {', '.join(sorted(classes))})")
    if classes == {positive}:
        what = f"every score is >= {threshold:g}" if ex.labels is None else f"every record has label {positive!r}"
        raise LabelError(f"{where}: {what}, so there is no negative example")
