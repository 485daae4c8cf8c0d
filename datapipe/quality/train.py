"""`datapipe classifier train` and `datapipe classifier score`: examples in, a model folder out (fastText or an
embedding head) with its held-out evaluation (and the TF-IDF baseline's) printed and saved as eval.json.

Output folder: fastText `model.bin` + `model.json`; embedding head `head.safetensors` + `head.json`; both
`eval.json`. Every file is a function of the data, the options and the seed (no times, no host names).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from datapipe.quality import evaluate
from datapipe.quality.labels import POSITIVE, Examples, LabelError, check_two_classes, read_examples
from storage.fs import file_sha256

FASTTEXT_MODEL, FASTTEXT_META, EVAL_JSON = "model.bin", "model.json", "eval.json"


@dataclass
class TrainOptions:
    kind: str  # fasttext | embedding
    data: list[str]
    output: str
    seed: int = 0
    positive_threshold: float = 3.0  # score >= this is positive (FineWeb-Edu: 3)
    label: str = POSITIVE  # the positive class: fastText's label for scores, or the user's label
    holdout: float = 0.1
    baseline: bool = False
    epochs: int | None = None  # fastText 5, head 20
    lr: float | None = None  # fastText 0.1, head 1e-3
    # fastText
    dim: int = 100
    word_ngrams: int = 2
    bucket: int = 2_000_000
    min_count: int = 1
    newline_replacement: str = " "
    # embedding head
    encoder: str | None = None
    max_length: int = 512
    batch_size: int = 64
    score_range: tuple[float, float] | None = None  # None: the training scores' min and max


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def train_classifier(opt: TrainOptions, echo=print) -> dict:
    """Read, split, train, evaluate, save; returns eval.json's content."""
    if opt.kind not in ("fasttext", "embedding"):
        raise LabelError(f"--kind must be fasttext or embedding, got {opt.kind!r}")
    if opt.kind == "embedding" and not opt.encoder:
        raise LabelError("--kind embedding needs --encoder DIR, a local Hugging Face encoder folder")
    ex = read_examples(opt.data)
    where = ", ".join(opt.data)
    check_two_classes(ex, opt.positive_threshold, opt.label, where)
    positive = ex.is_positive(opt.positive_threshold, opt.label)
    try:
        train_idx, test_idx = evaluate.split(len(ex), opt.holdout, opt.seed)
    except ValueError as e:
        raise LabelError(f"{where}: {e}") from None
    if len({positive[i] for i in train_idx}) < 2:
        raise LabelError(f"{where}: the training split holds one class only; give more examples of each")
    echo(f"{len(ex):,} examples ({sum(positive):,} positive) from {where}; skipped: "
         + (", ".join(f"{k} {v:,}" for k, v in ex.skipped.items()) or "none")
         + f"; {len(train_idx):,} to train, {len(test_idx):,} held out (seed {opt.seed})")
    os.makedirs(opt.output, exist_ok=True)
    texts = ex.texts
    test_texts = [texts[i] for i in test_idx]
    truth = [positive[i] for i in test_idx]
    if opt.kind == "fasttext":
        predicted, settings = _fasttext(opt, ex, train_idx, test_texts)
    else:
        predicted, settings = _embedding(opt, ex, train_idx, test_texts, echo)
    report = {"kind": opt.kind, "data": [{"path": os.path.abspath(p), "sha256": file_sha256(p)} for p in opt.data],
              "seed": opt.seed, "holdout": opt.holdout, "examples": len(ex), "skipped": ex.skipped,
              "train_examples": len(train_idx), "held_out_examples": len(test_idx),
              "positive": settings["positive"], "settings": settings, "model": evaluate.metrics(truth, predicted)}
    for line in evaluate.format_metrics(opt.kind, report["model"]):
        echo(line)
    if opt.baseline:
        pred = evaluate.baseline([texts[i] for i in train_idx], [positive[i] for i in train_idx], test_texts, opt.seed)
        report["baseline"] = {"name": "tfidf-logreg", **evaluate.metrics(truth, pred)}
        for line in evaluate.format_metrics("baseline (TF-IDF + logistic regression)", report["baseline"]):
            echo(line)
    _write_json(os.path.join(opt.output, EVAL_JSON), report)
    echo(f"model and {EVAL_JSON} written to {opt.output}")
    return report


def _fasttext(opt: TrainOptions, ex: Examples, train_idx: list[int], test_texts: list[str]):
    from datapipe.quality.fasttext_clf import FastTextScorer, train_fasttext

    classes = ex.classes(opt.positive_threshold, opt.label)
    epochs, lr = opt.epochs or 5, opt.lr or 0.1
    path = os.path.join(opt.output, FASTTEXT_MODEL)
    train_fasttext([ex.texts[i] for i in train_idx], [classes[i] for i in train_idx], path, opt.seed, dim=opt.dim,
                   epoch=epochs, lr=lr, word_ngrams=opt.word_ngrams, bucket=opt.bucket, min_count=opt.min_count,
                   newline_replacement=opt.newline_replacement)
    scorer = FastTextScorer(path, opt.label, opt.newline_replacement)
    predicted = [s >= scorer.default_threshold for s in scorer.score(test_texts)]
    settings = {"positive": f"label {opt.label!r}" + (f" (score >= {opt.positive_threshold:g})"
                                                      if ex.labels is None else ""),
                "labels": scorer.labels, "label": opt.label, "cut": scorer.default_threshold,
                "epochs": epochs, "lr": lr, "dim": opt.dim, "word_ngrams": opt.word_ngrams, "bucket": opt.bucket,
                "min_count": opt.min_count, "newline_replacement": opt.newline_replacement}
    _write_json(os.path.join(opt.output, FASTTEXT_META), {"format": "smoltrain-quality-fasttext/1",
                                                          "sha256": file_sha256(path), **settings})
    return predicted, settings


def _embedding(opt: TrainOptions, ex: Examples, train_idx: list[int], test_texts: list[str], echo):
    from datapipe.quality.embedding import Encoder, HeadScorer, save_head, train_head

    if ex.labels is not None:  # two labels: the positive one scores 1, the other 0
        kinds = sorted(set(ex.labels))
        if len(kinds) != 2:
            raise LabelError(f"{', '.join(opt.data)}: the regression head learns scores; labels need exactly two "
                             f"classes (the positive one scores 1), got {len(kinds)}: {', '.join(kinds)}")
        y = np.asarray([1.0 if lab == opt.label else 0.0 for lab in ex.labels])
        threshold, integer = 1.0, True
    else:
        y = np.asarray(ex.scores, dtype=np.float64)
        threshold, integer = opt.positive_threshold, bool(np.all(y == np.round(y)))
    lo, hi = opt.score_range or (float(y.min()), float(y.max()))
    if not lo < hi or not lo <= threshold <= hi:
        raise LabelError(f"--score-range [{lo:g}, {hi:g}] must be an interval holding the threshold {threshold:g}")
    epochs, lr = opt.epochs or 20, opt.lr or 1e-3
    encoder = Encoder(opt.encoder, opt.max_length)
    echo(f"embedding {len(train_idx):,} training texts with {encoder.folder} (hidden size {encoder.hidden_size})")
    x = encoder.embed([ex.texts[i] for i in train_idx])
    w, b = train_head(x, y[train_idx], opt.seed, epochs, lr, opt.batch_size)
    settings = {"positive": f"score >= {threshold:g}" + (" (int_score)" if integer else ""),
                "threshold": threshold, "integer_scores": integer, "score_range": [lo, hi],
                "epochs": epochs, "lr": lr, "batch_size": opt.batch_size, "max_length": opt.max_length,
                "encoder": encoder.folder, "encoder_sha256": encoder.fingerprint}
    save_head(opt.output, w, b, encoder, (lo, hi), threshold, integer,
              {k: settings[k] for k in ("epochs", "lr", "batch_size")} | {"seed": opt.seed,
                                                                          "examples": len(train_idx)})
    scorer = HeadScorer(opt.output)
    settings["cut"] = scorer.default_threshold
    predicted = [s >= scorer.default_threshold for s in scorer.score(test_texts)]
    return predicted, settings


def load_scorer(model: str, label: str = POSITIVE, newline_replacement: str = " "):
    """A fastText .bin file or an embedding-head folder, ready to score."""
    if os.path.isdir(model):
        from datapipe.quality.embedding import HeadScorer

        return HeadScorer(model)
    from datapipe.quality.fasttext_clf import FastTextScorer

    scorer = FastTextScorer(model, label, newline_replacement)
    if label not in scorer.labels:
        raise LabelError(f"{label!r} is not a label of model {model} (its labels: {', '.join(sorted(scorer.labels))})")
    return scorer


def score_file(model: str, path: str, out, label: str = POSITIVE, batch: int = 1024,
               newline_replacement: str = " ") -> int:
    """`classifier score`: one JSON line per record of `path` (`id` when it has one, and `score`)."""
    import gzip

    scorer = load_scorer(model, label, newline_replacement)
    n = 0
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        pending: list[dict] = []

        def flush():
            for rec, s in zip(pending, scorer.score([r["text"] for r in pending])):
                out.write(json.dumps({**({"id": rec["id"]} if "id" in rec else {}), "score": s}) + "\n")
            pending.clear()

        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise LabelError(f"{path} line {i}: needs a string 'text'")
            pending.append(rec)
            n += 1
            if len(pending) >= batch:
                flush()
        flush()
    return n

