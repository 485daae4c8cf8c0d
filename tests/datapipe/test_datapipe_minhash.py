"""MinHash: our signature files equal datatrove's; LSH candidate rates; fortunes' near-duplicate clusters."""
from __future__ import annotations

import json

import numpy as np
import pytest
from testutil import corpus_path, read_corpus, require

from datapipe.config import BuildConfig, MinhashSettings, SourceConfig, TokenizerConfig
from datapipe.dedup.minhash import FastMinhashSignature, minhash_config
from datapipe.pipeline import Build


def _shingle_set(text: str, n: int = 5) -> set[str]:
    from datatrove.utils.text import simplify_text

    w = simplify_text(text).split()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def _signature_files(folder, cfg) -> dict[int, list[tuple[int, ...]]]:
    """Document index → its hashes per bucket, read from a signature step's output with datatrove's reader."""
    from datatrove.io import get_datafolder
    from datatrove.pipeline.dedup.minhash import read_sigs

    df = get_datafolder(str(folder))
    out: dict[int, list[tuple[int, ...]]] = {}
    for bi in range(cfg.num_buckets):
        for hs in read_sigs(df.open(f"bucket_{bi:03d}/00000.minhash.sig", "rb"), 0, cfg):
            out.setdefault(hs.doc_id, []).append(hs.sig)
    return out


def test_signature_files_equal_datatrove_run(tmp_path):
    """A whole run of our signature step writes, document for document, the signature files that
    datatrove's spaCy-based MinhashDedupSignature writes for the same input."""
    require("spacy")
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import MinhashDedupSignature

    cfg = minhash_config(MinhashSettings())
    texts = [d["text"] for d in read_corpus("fortunes", 150) + read_corpus("pydoc", 60)
             + read_corpus("shakespeare", 15) + read_corpus("licenses")]
    n = len(texts)
    ours = FastMinhashSignature(str(tmp_path / "ours"), config=cfg)
    ref = MinhashDedupSignature(str(tmp_path / "ref"), config=cfg, language="en")
    for step in (ours, ref):
        step.run(iter([Document(text=t, id=str(i)) for i, t in enumerate(texts)]), rank=0, world_size=1)
    a, b = _signature_files(tmp_path / "ours", cfg), _signature_files(tmp_path / "ref", cfg)
    # datatrove writes every document with at least one 5-gram, in every bucket
    assert len(b) >= 0.95 * n and all(len(v) == cfg.num_buckets for v in b.values())
    differ = sorted(i for i in set(a) | set(b) if a.get(i) != b.get(i))
    assert len(differ) <= 0.01 * n, f"{len(differ)}/{n} documents with other signatures: {differ[:10]}"
    for i in differ:  # a difference may only come from the word split (the shingles), never the signature
        sa, sb = ours.get_shingles(texts[i]), ref.get_shingles(texts[i])
        assert sa.shape != sb.shape or not (sa == sb).all(), f"document {i}: same shingles, other signature"


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
