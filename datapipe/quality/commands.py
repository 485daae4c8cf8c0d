"""The `datapipe classifier` command group (`train`, `score`); the work is in datapipe.quality.train."""
from __future__ import annotations

import sys

import click

from storage.cliutil import die


@click.group()
def classifier() -> None:
    """Quality classifiers: train one on annotations or labels, score documents with it (see docs/datapipe.md,
    Quality classifiers). A build uses one through a `classifier` filter."""


@classifier.command("train")
@click.option("--kind", type=click.Choice(["fasttext", "embedding"]), required=True,
              help="fasttext: DCLM's bigram fastText classifier; embedding: FineWeb-Edu's regression head on a "
                   "frozen local encoder (--encoder).")
@click.option("--data", "data", multiple=True, required=True, metavar="FILE.jsonl",
              help="Examples (repeatable; .gz too): `datapipe annotate` output (text + score, null scores skipped) "
                   "or JSONL of text + score (a number) or text + label (one word).")
@click.option("--output", "-o", required=True, metavar="DIR",
              help="Model folder: model.bin (fastText) or head.safetensors + head.json (embedding), and eval.json.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Held-out split, example order and initialisation: same data + seed, byte-identical model.")
@click.option("--positive-threshold", type=float, default=3.0, show_default=True,
              help="Scores >= this are the positive class (FineWeb-Edu: 3 on its 0-5 scale).")
@click.option("--label", default="hq", show_default=True,
              help="The positive class: fastText's label for scores (the other is lq), or one of the data's labels.")
@click.option("--holdout", type=float, default=0.1, show_default=True, help="Share of the examples held out.")
@click.option("--baseline", is_flag=True,
              help="Also train and evaluate scikit-learn's TF-IDF + logistic regression on the same split.")
@click.option("--epochs", type=int, default=None, help="Training epochs (fastText 5, embedding head 20).")
@click.option("--lr", type=float, default=None, help="Learning rate (fastText 0.1, embedding head Adam 1e-3).")
@click.option("--dim", type=int, default=100, show_default=True, help="fastText: vector size.")
@click.option("--word-ngrams", type=int, default=2, show_default=True, help="fastText: word n-grams (DCLM: 2).")
@click.option("--bucket", type=int, default=2_000_000, show_default=True,
              help="fastText: hash buckets of the n-grams (model size is about (words + bucket) x dim x 4 bytes).")
@click.option("--encoder", metavar="DIR", default=None,
              help="embedding: a local Hugging Face encoder folder (safetensors weights; never downloaded).")
@click.option("--max-length", type=int, default=512, show_default=True, help="embedding: tokens read per text.")
@click.option("--score-range", type=float, nargs=2, default=None, metavar="LO HI",
              help="embedding: scores are clipped to this range (default: the training scores' min and max).")
def train(kind, data, output, seed, positive_threshold, label, holdout, baseline, epochs, lr, dim, word_ngrams,
          bucket, encoder, max_length, score_range) -> None:
    """Train a quality classifier on --data, print and save its held-out precision, recall, F1 and confusion
    matrix at the threshold."""
    from datapipe.quality.embedding import HeadError
    from datapipe.quality.labels import LabelError
    from datapipe.quality.train import TrainOptions, train_classifier

    opt = TrainOptions(kind, list(data), output, seed, positive_threshold, label, holdout, baseline, epochs, lr,
                       dim=dim, word_ngrams=word_ngrams, bucket=bucket, encoder=encoder, max_length=max_length,
                       score_range=tuple(score_range) if score_range else None)
    try:
        train_classifier(opt, echo=click.echo)
    except (LabelError, HeadError) as e:
        die(str(e))


@classifier.command("score")
@click.argument("model")
@click.argument("file")
@click.option("--label", default="hq", show_default=True, help="fastText: the label whose probability is the score.")
@click.option("--output", "-o", default="-", show_default=True, help="JSONL of id and score (-: standard output).")
def score(model, file, label, output) -> None:
    """Score FILE.jsonl's texts with MODEL (a fastText .bin or an embedding-head folder)."""
    import os

    from datapipe.quality.embedding import HeadError
    from datapipe.quality.labels import LabelError
    from datapipe.quality.train import score_file

    if not os.path.exists(model):
        die(f"model {model!r} not found (a fastText .bin or an embedding-head folder)")
    try:
        if output == "-":
            n = score_file(model, file, sys.stdout, label)
        else:
            with open(output, "w", encoding="utf-8") as f:
                n = score_file(model, file, f, label)
    except (LabelError, HeadError, FileNotFoundError) as e:
        die(str(e))
    click.echo(f"scored {n:,} documents", err=True)
