"""Verified MinHash candidates: the sketch's Jaccard estimate stays within its error bound; a pair that
collides in a band at low Jaccard is dropped before clustering and a close pair is kept; long band runs;
the numpy union-find. And the faster steps: our shingling gives datatrove's text and words, our
permutation product its signature values, our bucket stage its `.dups` bytes."""
from __future__ import annotations

import numpy as np
import pytest
from testutil import read_corpus

from datapipe.config import MinhashSettings
from datapipe.dedup.minhash import FastMinhashSignature, minhash_config, simplify, words_of
from datapipe.dedup.verify import (
    SKETCH_BINS,
    MinhashVerify,
    SketchReader,
    estimate_jaccard,
    join,
    roots,
    sketch,
    standard_error,
)
from storage.config import ConfigError


def _sets(rng, size: int, j: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Two sets of `size` random 64-bit shingle hashes with Jaccard close to j, and their exact Jaccard."""
    common = round(2 * size * j / (1 + j))
    vals = rng.choice(2**62, size=common + 2 * (size - common), replace=False).astype(np.uint64)
    a, b = vals[:size], np.concatenate([vals[:common], vals[size:]])
    return a, b, common / (2 * size - common)


def test_estimate_within_its_bound():
    rng = np.random.default_rng(0)
    errors = []
    for size in (20, 150, 400, 3000):
        for j in (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0):
            for _ in range(40):
                a, b, exact = _sets(rng, size, j)
                est, n_union = estimate_jaccard(sketch(a), sketch(b))
                assert abs(est - exact) <= 4 * standard_error(exact, n_union) + 1e-9, (size, exact, est, n_union)
                errors.append(est - exact)
    assert abs(np.mean(errors)) < 0.005  # unbiased
    assert sketch(np.zeros(0, dtype=np.uint64)).tolist() == [0] * SKETCH_BINS


def _words(rng, n: int) -> list[str]:
    return ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=6)) for _ in range(n)]


def _jaccard(x: str, y: str) -> float:
    sx, sy = (set(FastMinhashSignature("/tmp/unused-sig").get_shingles(t).reshape(-1).tolist()) for t in (x, y))
    return len(sx & sy) / len(sx | sy)


def test_low_pair_colliding_in_a_band_is_dropped_close_pair_kept(tmp_path):
    """Real stages on two tasks: A and its edit B (J ~0.87) stay one cluster; C shares a boilerplate
    block with A (J ~0.39), collides with it in a band of a 40 x 2 banding, and is dropped by verify,
    even in a band run where it sits between A and B."""
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets, MinhashDedupCluster

    rng = np.random.default_rng(1)
    a = _words(rng, 300)
    b = list(a)
    for pos in (40, 110, 180, 250):
        b[pos] = "zzzzzz"
    c = a[:170] + _words(rng, 130)
    A, B, C = (" ".join(w) for w in (a, b, c))
    assert 0.8 < _jaccard(A, B) < 0.9 and 0.35 < _jaccard(A, C) < 0.45
    cfg = minhash_config(MinhashSettings(bands=40, rows=2))
    for rank, texts in enumerate([[A, "too short", C], [B]]):
        FastMinhashSignature(str(tmp_path / "sigs"), cfg, sketch_folder=str(tmp_path / "sk")).run(
            iter([Document(text=t, id=str(i)) for i, t in enumerate(texts)]), rank=rank, world_size=2)
    assert np.load(tmp_path / "sk" / "00000.sketch.npy").shape == (3, SKETCH_BINS)  # one row per document
    for band in range(cfg.num_buckets):
        MinhashDedupBuckets(str(tmp_path / "sigs"), str(tmp_path / "buckets"), config=cfg).run(
            rank=band, world_size=cfg.num_buckets)
    cand = np.concatenate([np.fromfile(p, dtype="<u4").reshape(-1, 4) for p in (tmp_path / "buckets").iterdir()])
    assert {(0, 0, 0, 2)} <= set(map(tuple, cand.tolist()))  # A-C collides in some band
    verify = MinhashVerify(str(tmp_path / "buckets"), str(tmp_path / "sk"), str(tmp_path / "verified"), 0.7)
    for band in range(cfg.num_buckets):
        verify.run(rank=band, world_size=cfg.num_buckets)
    stats = {k: int(v.total) for k, v in verify.stats.stats.items()}
    assert stats["pairs_below_threshold"] > 0 and stats["candidate_pairs_dropped"] > 0
    MinhashDedupCluster(str(tmp_path / "verified"), str(tmp_path / "clusters"), config=cfg).run()
    removed = {r: np.fromfile(tmp_path / "clusters" / f"{r:06d}.remove", dtype="<u4").tolist()
               for r in (0, 1) if (tmp_path / "clusters" / f"{r:06d}.remove").exists()}
    assert sorted((r, d) for r, ds in removed.items() for d in ds) in ([(0, 0)], [(1, 0)])  # A or B, not C
    # a band run [A, C, B] as datatrove writes it, a chain of consecutive pairs: A-B is still joined
    chain = np.array([[0, 0, 0, 2], [0, 2, 1, 0]], dtype="<u4")
    assert verify.verify(chain, SketchReader(str(tmp_path / "sk"))).tolist() == [[0, 0, 1, 0]]


def test_long_run_joins_duplicates_and_skips_joined_pairs(tmp_path):
    """A band run of 100 copies of one sketch then 50 unrelated ones: one star from the first copy; anchor 0
    checks all 149 others, anchors 1..63 only the 50 unrelated (pairs already joined are not checked)."""
    rng = np.random.default_rng(4)
    dup = rng.integers(1, 256, SKETCH_BINS, dtype=np.uint8)
    np.save(tmp_path / "00000.sketch.npy", np.stack([dup] * 100 + [rng.integers(1, 256, SKETCH_BINS, dtype=np.uint8)
                                                                   for _ in range(50)]))
    chain = np.array([[0, k, 0, k + 1] for k in range(149)], dtype="<u4")
    verify = MinhashVerify("unused", str(tmp_path), "unused", 0.7)
    assert verify.verify(chain, SketchReader(str(tmp_path))).tolist() == [[0, 0, 0, k] for k in range(1, 100)]
    stats = {k: int(v.total) for k, v in verify.stats.stats.items()}
    assert stats["pairs_checked"] == 149 + 63 * 50 and stats["pairs_below_threshold"] == 50 + 63 * 50


def test_union_find_in_numpy_matches_python():
    rng = np.random.default_rng(3)
    for n in (2, 30, 400):
        edges = rng.integers(0, n, size=(int(rng.integers(1, 2 * n)), 2))
        parent = list(range(n))

        def find(x):
            while parent[x] != x:
                x = parent[x]
            return x

        for u, v in edges.tolist():
            ru, rv = find(u), find(v)
            parent[max(ru, rv)] = min(ru, rv)
        label = np.arange(n)
        for chunk in np.array_split(edges, 3):  # edges arrive in batches, as the verify stage checks them
            join(label, chunk[:, 0], chunk[:, 1])
        assert roots(label, np.arange(n)).tolist() == [find(x) for x in range(n)]


def test_minhashes_equal_datatroves_signature():
    """Our permutation product (blocks, Mersenne fold) gives `get_signature`'s values, 64- and 32-bit."""
    rng = np.random.default_rng(5)
    edge = np.array([0, 1, (1 << 61) - 2, (1 << 61) - 1, 1 << 61, (1 << 64) - 1], dtype=np.uint64)
    for bits in (64, 32):
        step = FastMinhashSignature("/tmp/unused-sig", minhash_config(MinhashSettings(hash_bits=bits)))
        for n in (1, 6, 700, 9000):
            h = np.concatenate([edge, rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64)]).reshape(-1, 1)
            assert step.minhashes(h).tolist() == [x for band in step.get_signature(h) for x in band]


def test_verify_threshold_validated():
    MinhashSettings(verify_threshold=None).validate()
    MinhashSettings(verify_threshold=0).validate()
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="verify_threshold"):
            MinhashSettings(verify_threshold=bad).validate()


def test_fast_shingling_gives_datatroves_text_and_words():
    from datatrove.utils.text import TextNormConfig, simplify_text

    from datapipe.wordtok import tokenize_words

    texts = [d["text"] for d in read_corpus("pydoc", 150) + read_corpus("shakespeare", 20)
             + read_corpus("fortunes", 300)]
    texts += ["Crème brûlée\u00a0costs 3,50 € — naïve café\u2003ÅNGSTRÖM", "dont cant 10km 2nd x\u0301y\u0327",
              "\x1ctab\tand\x0bvtab  ", "Ǆemal İstanbul ﬁnance"]
    for norm in (TextNormConfig(), TextNormConfig(lowercase=False, remove_punctuation=False, norm_weekdays=True)):
        for t in texts:
            s = simplify_text(t, norm)
            assert simplify(t, norm) == s and simplify(t, norm, split=True) == s.split()
            assert words_of(s.split()) == tokenize_words(s)


def test_fast_buckets_write_datatroves_dups(tmp_path):
    """Three tasks of documents with planted near duplicates: our bucket stage writes datatrove's `.dups`
    bytes, with two workers per band and sub-ranges of a few records."""
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import MinhashDedupBuckets

    from datapipe.dedup.buckets import FastMinhashBuckets

    rng = np.random.default_rng(2)
    texts = [" ".join(_words(rng, int(rng.integers(8, 60)))) for _ in range(151)]
    # 151 originals: each copy (edited or exact) lands in another task than its original
    texts += [t.replace(t.split()[3], "edited", 1) for t in texts[:60]] + texts[60:70]
    cfg = minhash_config(MinhashSettings(bands=6, rows=2))
    for rank in range(3):
        FastMinhashSignature(str(tmp_path / "sigs"), cfg).run(
            iter([Document(text=t, id=str(i)) for i, t in enumerate(texts[rank::3])]), rank=rank, world_size=3)
    for step, out in ((MinhashDedupBuckets, "ref"), (FastMinhashBuckets, "ours")):
        kwargs = {"max_records": 7} if step is FastMinhashBuckets else {}
        for rank in range(2 * cfg.num_buckets):
            step(str(tmp_path / "sigs"), str(tmp_path / out), config=cfg, **kwargs).run(
                rank=rank, world_size=2 * cfg.num_buckets)
    names = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ours").iterdir()) and len(names) == 2 * cfg.num_buckets
    assert sum((tmp_path / "ref" / n).stat().st_size for n in names) > 16 * 60
    for n in names:
        assert (tmp_path / "ours" / n).read_bytes() == (tmp_path / "ref" / n).read_bytes(), n
