"""Held-out evaluation of a quality classifier: a seeded split of the examples, precision, recall, F1 and
a confusion matrix of the positive class at the threshold, and the scikit-learn TF-IDF + logistic-regression
baseline trained and judged on the same split."""
from __future__ import annotations

import numpy as np


def split(n: int, holdout: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices, each in input order: a seeded permutation's first `holdout` share is
    held out (at least one example, and at least one left to train on)."""
    if not 0 < holdout < 1:
        raise ValueError(f"--holdout must be in (0, 1), got {holdout}")
    if n < 2:
        raise ValueError(f"{n} example(s): at least 2 are needed to train and evaluate")
    k = min(max(1, round(n * holdout)), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return sorted(perm[k:].tolist()), sorted(perm[:k].tolist())


def metrics(truth: list[bool], predicted: list[bool]) -> dict:
    """Precision, recall, F1 and accuracy of the positive class, with the confusion matrix."""
    t, p = np.asarray(truth, dtype=bool), np.asarray(predicted, dtype=bool)
    tp, fp = int((t & p).sum()), int((~t & p).sum())
    fn, tn = int((t & ~p).sum()), int((~t & ~p).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"examples": len(t), "positives": int(t.sum()), "precision": round(precision, 6),
            "recall": round(recall, 6), "f1": round(f1, 6), "accuracy": round((tp + tn) / max(len(t), 1), 6),
            "confusion": {"true_positive": tp, "false_positive": fp, "false_negative": fn, "true_negative": tn}}


def format_metrics(name: str, m: dict) -> list[str]:
    c = m["confusion"]
    return [f"{name}: precision {m['precision']:.3f}, recall {m['recall']:.3f}, F1 {m['f1']:.3f}, accuracy "
            f"{m['accuracy']:.3f} on {m['examples']:,} held-out examples ({m['positives']:,} positive)",
            f"  confusion (rows: true positive / negative; columns: predicted positive / negative): "
            f"[[{c['true_positive']}, {c['false_negative']}], [{c['false_positive']}, {c['true_negative']}]]"]


def baseline(train_texts: list[str], train_pos: list[bool], test_texts: list[str], seed: int) -> list[bool]:
    """TF-IDF (word 1-2-grams, sublinear tf) + logistic regression; positive where its probability >= 0.5."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1, max_features=500_000)
    clf = LogisticRegression(max_iter=1000, random_state=seed)
    clf.fit(vec.fit_transform(train_texts), np.asarray(train_pos, dtype=int))
    return (clf.predict_proba(vec.transform(test_texts))[:, 1] >= 0.5).tolist()
