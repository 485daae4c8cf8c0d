"""The near-duplicate benchmark corpus (tools/bench/bench_neardup.py): documents from ../shared/corpora with
variants at a known exact Jaccard of their word 5-gram sets, and families sharing a boilerplate block."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

CORPORA = Path(__file__).resolve().parents[3] / "shared" / "corpora"
BUCKETS = (0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0001)


def corpus_docs(name: str) -> list[str]:
    with gzip.open(CORPORA / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def shingle_set(text: str) -> frozenset[str]:
    """The exact 5-gram set the MinHash stages hash: datatrove's simplified text, our (spaCy-equal) split."""
    from datatrove.utils.text import simplify_text

    from datapipe.wordtok import tokenize_words

    w = tokenize_words(simplify_text(text))
    return frozenset(" ".join(w[i:i + 5]) for i in range(len(w) - 4))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def make_variant(rng: random.Random, text: str, target: float, vocab: list[str]) -> tuple[str, float]:
    """Word edits of `text` (a fixed random sequence; its shortest prefix at or below `target`, or the
    one before it if closer) → (variant text, exact Jaccard)."""
    words = text.split()
    base = shingle_set(text)
    clustered = rng.random() < 0.4
    centers = [rng.random() for _ in range(3)]
    edits = []
    for _ in range(len(words)):
        pos = (min(max(rng.choice(centers) + rng.gauss(0, 0.03), 0), 1) if clustered else rng.random())
        edits.append((rng.choices("sid", (2, 1, 1))[0], pos, rng.choice(vocab)))

    def apply(k: int) -> tuple[str, float]:
        w = list(words)
        for op, pos, new in edits[:k]:
            i = min(int(pos * len(w)), len(w) - 1)
            if op == "s":
                w[i] = new
            elif op == "i":
                w.insert(i, new)
            elif len(w) > 10:
                del w[i]
        out = " ".join(w)
        return out, jaccard(base, shingle_set(out))

    lo, hi = 1, len(edits)  # smallest k with J(k) <= target
    while lo < hi:
        mid = (lo + hi) // 2
        if apply(mid)[1] <= target:
            hi = mid
        else:
            lo = mid + 1
    best = apply(lo)
    if lo > 1:
        prev = apply(lo - 1)
        if abs(prev[1] - target) < abs(best[1] - target):
            best = prev
    return best


def build_corpus(n_pairs: int, families: int, members: int, n_plain: int, seed: int = 0):
    """→ (texts, pairs [(i, j, exact J)], family of each boilerplate document)."""
    rng = random.Random(seed)
    pool = [t for t in corpus_docs("pydoc") + corpus_docs("shakespeare") if 60 <= len(t.split()) <= 3000]
    pool = list(dict.fromkeys(pool))
    rng.shuffle(pool)
    fortunes = [t for t in dict.fromkeys(corpus_docs("fortunes")) if len(t.split()) >= 5]
    rng.shuffle(fortunes)
    licenses = corpus_docs("licenses")
    vocab = sorted({w for t in pool[:300] for w in t.split() if w.isalpha()})
    texts: list[str] = []
    pairs = []
    for k in range(n_pairs):
        b = rng.randrange(len(BUCKETS) - 1)
        target = rng.uniform(BUCKETS[b], min(BUCKETS[b + 1], 0.995))
        variant, j = make_variant(rng, pool[k], target, vocab)
        pairs.append((len(texts), len(texts) + 1, j))
        texts += [pool[k], variant]
    family = {}
    for f in range(families):
        lic = licenses[f % len(licenses)].split()
        size = rng.randint(80, 200)
        start = rng.randrange(len(lic) - size)
        block = lic[start:start + size]
        for _ in range(members):
            body: list[str] = []
            want = int(size * rng.uniform(0.5, 1.2))
            while len(body) < want:
                body += fortunes.pop().split()
            family[len(texts)] = f
            texts.append(" ".join(block[:size // 2]) + "\n\n" + " ".join(body) + "\n\n" + " ".join(block[size // 2:]))
    texts += pool[n_pairs:n_pairs + n_plain]
    order = list(range(len(texts)))
    rng.shuffle(order)
    pos = {old: new for new, old in enumerate(order)}
    return ([texts[i] for i in order], [(pos[i], pos[j], jv) for i, j, jv in pairs],
            {pos[i]: f for i, f in family.items()})
