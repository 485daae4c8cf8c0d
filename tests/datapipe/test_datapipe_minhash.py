"""MinHash: our signature step equals datatrove's; LSH candidate rates; fortunes' near-duplicate clusters."""
from __future__ import annotations

import json

import numpy as np
import pytest
from testutil import corpus_path, read_corpus

from datapipe.config import BuildConfig, MinhashSettings, SourceConfig, TokenizerConfig
from datapipe.dedup.minhash import FastMinhashSignature, minhash_config
from datapipe.pipeline import Build


def _shingle_set(text: str, n: int = 5) -> set[str]:
    from datatrove.utils.text import simplify_text

    w = simplify_text(text).split()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def test_fast_signatures_equal_datatrove(tmp_path):
    pytest.importorskip("spacy")
    from datatrove.pipeline.dedup.minhash import MinhashDedupSignature

    cfg = minhash_config(MinhashSettings())
    ours = FastMinhashSignature(str(tmp_path / "a"), config=cfg)
    ref = MinhashDedupSignature(str(tmp_path / "b"), config=cfg, language="en")
    docs = read_corpus("fortunes", 150) + read_corpus("pydoc", 60) + read_corpus("shakespeare", 15)
    docs += read_corpus("licenses")
    same = 0
    for d in docs:
        a, b = ours.get_shingles(d["text"]), ref.get_shingles(d["text"])
        if a.shape == b.shape and (a == b).all():
            same += 1
            if a.size:
                assert ours.get_signature(a) == ref.get_signature(b)
    assert same >= 0.99 * len(docs), f"{same}/{len(docs)} documents with identical shingles"


def test_candidate_rate_follows_lsh_curve():
    """Pairs of shingle sets with Jaccard s become candidates with probability 1-(1-s^r)^b."""
    settings = MinhashSettings()
    sig = FastMinhashSignature("/tmp/unused-minhash", config=minhash_config(settings))
    rng = np.random.default_rng(0)
    union, pairs = 120, 600
    for s in (0.5, 0.65, 0.75, 0.85, 0.95):
        common = round(s * union)
        hits = 0
        for _ in range(pairs):
            vals = rng.integers(1, 2**63, size=common + 2 * (union - common), dtype=np.uint64)
            a = np.concatenate([vals[:common], vals[common:common + union - common]]).reshape(-1, 1)
            b = np.concatenate([vals[:common], vals[common + union - common:]]).reshape(-1, 1)
            sa, sb = sig.get_signature(a), sig.get_signature(b)
            hits += any(x == y for x, y in zip(sa, sb))
        real_s = common / (2 * union - common)
        expected = 1 - (1 - real_s ** settings.rows) ** settings.bands
        assert abs(hits / pairs - expected) < 0.06, (s, real_s, hits / pairs, expected)


@pytest.mark.slow
def test_fortunes_near_duplicate_clusters(tmp_path, small_tokenizer):
    cfg = BuildConfig(output=str(tmp_path / "out"),
                      sources=[SourceConfig("web", [str(corpus_path("fortunes"))], filters=[])],
                      tokenizer=TokenizerConfig(path=small_tokenizer))
    Build(cfg).run(progress=False)
    exact, near = ([json.loads(x) for x in (tmp_path / "out" / "dedup" / name).read_text().splitlines()]
                   for name in ("exact_clusters.jsonl", "near_dup_clusters.jsonl"))
    assert 70 <= len(exact) <= 110  # the corpus README: ~92 exact repeats
    assert 230 <= len(near) <= 330  # ~290 near-duplicate clusters
    texts = {f"web/{d['id']}": d["text"] for d in read_corpus("fortunes")}
    close = total = 0
    for c in near:
        a = _shingle_set(texts[c["kept"]])
        for r in c["removed"]:
            b = _shingle_set(texts[r])
            total += 1
            close += len(a & b) / max(1, len(a | b)) >= 0.5
    assert close >= 0.95 * total, f"only {close}/{total} removed near-duplicates have Jaccard >= 0.5"
