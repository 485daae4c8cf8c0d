"""fastText quality classifiers, DCLM's recipe: `fasttext.train_supervised` on `__label__hq` / `__label__lq`
lines with word bigrams, and batched scoring whose numbers equal datatrove's `FastTextClassifierFilter`.

A document's text is prepared as datatrove prepares it (`text.strip().replace("\\n", newline_replacement)`:
fastText reads one line and takes a newline for the end of a sentence), for training and scoring alike,
and its score is fastText's probability of the positive label (`predict(k=-1)`). Training runs in one
thread with a fixed seed on the examples shuffled by that seed, in a fresh Python process: fastText 0.9.2
(`fasttext-numpy2-wheel`) trained twice in one process gives other weights the second time, often NaNs
("Encountered NaN"), while each fresh process gives the same bytes. So the same data and seed give a
byte-identical model file.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile

LABEL_PREFIX = "__label__"
NEWLINE = " "  # what a newline becomes before fastText reads a text (datatrove's default is "")


def prepare(text: str, newline_replacement: str = NEWLINE) -> str:
    """The one line fastText reads for `text` (datatrove's preprocessing)."""
    return text.strip().replace("\n", newline_replacement)


def train_fasttext(texts: list[str], classes: list[str], out_path: str, seed: int, *, dim: int = 100,
                   epoch: int = 5, lr: float = 0.1, word_ngrams: int = 2, bucket: int = 2_000_000,
                   min_count: int = 1, newline_replacement: str = NEWLINE) -> str:
    """Train a supervised fastText model on `texts` with one class each and save it to `out_path`."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)  # fastText reads the file in order: classes must be mixed
    with tempfile.TemporaryDirectory(prefix="fasttext-train-") as tmp:
        data = os.path.join(tmp, "train.txt")
        with open(data, "w", encoding="utf-8", newline="\n") as f:
            for i in order:
                f.write(f"{LABEL_PREFIX}{classes[i]} {prepare(texts[i], newline_replacement)}\n")
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        part = f"{out_path}.part-{os.getpid()}"
        args = dict(input=data, dim=dim, epoch=epoch, lr=lr, wordNgrams=word_ngrams, bucket=bucket, minCount=min_count,
                    loss="softmax", thread=1, seed=seed, verbose=0)
        res = subprocess.run([sys.executable, "-c", _TRAIN, json.dumps(args), part], capture_output=True, text=True)
        if res.returncode != 0:
            err = (res.stderr.strip().splitlines() or ["(no message)"])[-1]
            hint = "; a lower --lr avoids a diverging run" if "NaN" in err else ""
            raise RuntimeError(f"fastText training failed: {err}{hint}")
    os.replace(part, out_path)
    return out_path


# the training process: fastText's train_supervised, then save_model (see the module's docstring)
_TRAIN = """import json, sys
import fasttext
fasttext.train_supervised(**json.loads(sys.argv[1])).save_model(sys.argv[2])
"""


def model_labels(model) -> list[str]:
    """A loaded model's labels without fastText's prefix."""
    return [lab.removeprefix(LABEL_PREFIX) for lab in model.get_labels()]


class FastTextScorer:
    """Scores texts with a fastText model: the probability of `label`, as datatrove's filter computes it."""

    kind = "fasttext"
    score_range = (0.0, 1.0)
    default_threshold = 0.5  # the positive label more likely than not (of two)

    def __init__(self, path: str, label: str = "hq", newline_replacement: str = NEWLINE):
        import fasttext

        self.path, self.label, self.newline_replacement = path, label, newline_replacement
        self.model = fasttext.load_model(path)
        self.labels = model_labels(self.model)
        self.target = LABEL_PREFIX + label

    def score(self, texts: list[str]) -> list[float]:
        """One probability per text, in one call into fastText for the whole list (no per-text Python call
        into the model)."""
        if not texts:
            return []
        nl, target = self.newline_replacement, self.target
        lines = [t.strip().replace("\n", nl) + "\n" for t in texts]
        all_labels, all_probs = self.model.f.multilinePredict(lines, -1, 0.0, "strict")
        out = []
        for labels, probs in zip(all_labels, all_probs):
            try:
                out.append(float(probs[labels.index(target)]))
            except ValueError:  # not returned (never with softmax and threshold 0): datatrove drops it too
                out.append(-9e9)
        return out


def score_texts(model_path: str, texts: list[str], label: str = "hq", newline_replacement: str = NEWLINE) -> list[float]:
    """The probabilities of `label` for `texts` (for benchmarks and scripts; the filter keeps its scorer)."""
    return FastTextScorer(model_path, label, newline_replacement).score(texts)
