"""A multilingual near-duplicate set at known Jaccard from real Chinese and Japanese (and English) text:
used by tools/bench/bench_multilingual.py and tests/datapipe/test_datapipe_multilingual.py.

Jaccard is measured exactly on sets of word 5-grams of datatrove's simplified text (`simplify_text`),
the words found without datapipe's code: SudachiPy's (mode A) for a Japanese text, as datatrove's
jpn_Jpan; otherwise jieba's (rjieba) for a whitespace chunk with Han characters, the chunk itself for
the others (FineWeb-2's word units). Each base document gets one variant made by word edits (substitutions with words
of other documents of its language, insertions, deletions; scattered or clustered) until the Jaccard of
the pair reaches a target drawn uniformly from [0.5, 0.97]; the variant's text is its words joined as the
language writes them (no spaces in Chinese and Japanese), so the segmenter sees it afresh.
Traps, which must stay apart: families of documents sharing one boilerplate block around a unique body
(pairwise Jaccard < 0.5), and the remaining base documents of the same man pages (same vocabulary and
layout, other content).
"""
from __future__ import annotations

import random

from datatrove.utils.text import TextNormConfig

_NORM = TextNormConfig()


def words(text: str, lang: str) -> list[str]:
    import re

    import rjieba
    from datatrove.utils.text import simplify_text

    if lang == "ja":
        return [m.surface() for m in _sudachi().tokenize(simplify_text(text, _NORM)) if m.surface().strip()]
    out = []
    for chunk in simplify_text(text, _NORM).split():
        if not re.search(r"[\u3040-\u30ff\u3400-\u9fff]", chunk):
            out.append(chunk)
        elif lang == "ja":
            out += [m.surface() for m in _sudachi().tokenize(chunk)]
        else:
            out += rjieba.cut(chunk)
    return [w for w in out if w.strip()]


_SUDACHI = []


def _sudachi():
    if not _SUDACHI:
        from sudachipy import Dictionary, SplitMode

        _SUDACHI.append(Dictionary(dict="core").tokenizer(mode=SplitMode.A))
    return _SUDACHI[0]


def shingles(text: str, lang: str, n: int = 5) -> frozenset[str]:
    w = words(text, lang)
    return frozenset(" ".join(w[i:i + n]) for i in range(len(w) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _join(tokens: list[str], lang: str) -> str:
    """Words as the language writes them: Chinese and Japanese words abut, other words (Latin ones in a
    Chinese text too) are separated by a space."""
    if lang not in ("zh", "ja"):
        return " ".join(tokens)
    out = ""
    for t in tokens:
        if out and not (_wide(out[-1]) and _wide(t[0])):
            out += " "
        out += t
    return out


def _wide(c: str) -> bool:
    import unicodedata

    return unicodedata.east_asian_width(c) in ("W", "F")


def make_variant(rng: random.Random, text: str, lang: str, target: float, vocab: list[str]) -> tuple[str, float]:
    """Edits of `text`'s words: the shortest prefix of a fixed random edit sequence at or below `target`
    (or the one before it, if closer) → (variant, exact Jaccard)."""
    from datapipe.wordtok import tokenize_words

    toks = tokenize_words(text, lang)
    base = shingles(text, lang)
    clustered = rng.random() < 0.4
    centers = [rng.random() for _ in range(3)]
    edits = []
    for _ in range(len(toks)):
        pos = min(max(rng.choice(centers) + rng.gauss(0, 0.03), 0), 1) if clustered else rng.random()
        edits.append((rng.choices("sid", (2, 1, 1))[0], pos, rng.choice(vocab)))

    def apply(k: int) -> tuple[str, float]:
        w = list(toks)
        for op, pos, new in edits[:k]:
            i = min(int(pos * len(w)), len(w) - 1)
            if op == "s":
                w[i] = new
            elif op == "i":
                w.insert(i, new)
            elif len(w) > 10:
                del w[i]
        out = _join(w, lang)
        return out, jaccard(base, shingles(out, lang))

    lo, hi = 1, len(edits)
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


def build_set(bases: dict[str, list[str]], pairs: int, families: int = 6, family_size: int = 6, seed: int = 35):
    """(texts, languages, pairs [(i, j, jaccard, lang)], traps [(i, j)]): `pairs` base documents per language
    with a variant each, `families` boilerplate families per language, the other base documents alone;
    shuffled."""
    rng = random.Random(seed)
    docs: list[tuple[str, str, tuple]] = []  # text, lang, tag
    for lang, texts in bases.items():
        texts = [t for t in texts if len(shingles(t, lang)) >= 20]
        vocab = sorted({w for t in texts for w in words(t, lang) if len(w) > 1})
        order = rng.sample(range(len(texts)), len(texts))
        with_variant, rest = order[:pairs], order[pairs:]
        for k in with_variant:
            target = rng.uniform(0.5, 0.97)
            var, jv = make_variant(rng, texts[k], lang, target, vocab)
            docs += [(texts[k], lang, ("pair", lang, k, jv, 0)), (var, lang, ("pair", lang, k, jv, 1))]
        boiler = [texts[k] for k in rest[:families]]
        bodies = rest[families:families + families * family_size]
        for f, b in enumerate(boiler):
            for k in bodies[f * family_size:(f + 1) * family_size]:
                docs.append((_join([b, texts[k]], lang) if lang in ("zh", "ja") else f"{b}\n\n{texts[k]}",
                             lang, ("family", lang, f)))
        docs += [(texts[k], lang, ("alone",)) for k in rest[families + families * family_size:]]
    rng.shuffle(docs)
    index: dict[tuple, list[int]] = {}
    for i, (_, _, tag) in enumerate(docs):
        if tag[0] == "pair":
            index.setdefault(tag[1:3], [None, None])[tag[4]] = i
        elif tag[0] == "family":
            index.setdefault(tag, []).append(i)
    out_pairs = [(v[0], v[1], docs[v[0]][2][3], k[0]) for k, v in index.items() if len(k) == 2]
    traps = [(a, b) for k, v in index.items() if len(k) == 3 for x, a in enumerate(v) for b in v[x + 1:]]
    return [d[0] for d in docs], [d[1] for d in docs], out_pairs, traps
