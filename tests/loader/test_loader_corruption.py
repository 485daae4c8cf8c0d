"""Corruption policy: `error` names shard, member and offset; `quarantine` skips identically on all ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.shards import ShardError


def test_error_policy_names_shard_member_offset(corrupt_ds, loader_factory, ld):
    loader = loader_factory(corrupt_ds["root"])
    with pytest.raises(ShardError) as ei:
        ld.take(loader, 12)
    msg = str(ei.value)
    assert corrupt_ds["shard"] in msg and corrupt_ds["member"] in msg and f"offset {corrupt_ds['offset']}" in msg
    assert "checksum" in msg


def _contains_run_of(rows: np.ndarray, block: np.ndarray, n: int = 12) -> bool:
    grams = {block[i:i + n].tobytes() for i in range(len(block) - n + 1)}
    return any(r[i:i + n].tobytes() in grams for r in rows for i in range(len(r) - n + 1))


def test_quarantine_skips_identically_on_all_ranks(corrupt_ds, loader_factory):
    root, clean, bad = corrupt_ds["root"], torch.cat(corrupt_ds["clean"]).numpy(), corrupt_ds["block"]
    runs, substituted = {}, {}
    for world in (1, 2):
        loaders = [loader_factory(root, rank=r, world=world, corruption="quarantine") for r in range(world)]
        runs[world] = torch.cat([torch.cat([next(x) for x in loaders]) for _ in range(12)])
        assert max(x.metrics()["quarantined_blocks"] for x in loaders) == 1
        substituted[world] = sum(x.metrics()["substituted_sequences"] for x in loaders)
    assert torch.equal(runs[1], runs[2]), "ranks must replace the same sequences with the same stand-ins"
    got = runs[1].numpy()
    # The rows the corrupt block feeds, from the order alone (no data read): global sequence i is row i
    # of the concatenated batches; it is fed by block `bad` of source 0 when one of its pieces lies there.
    probe = loader_factory(root)
    srcs, curs = probe.assignments(0, len(got))
    web = probe.orders[0]
    feeds = [i for i in range(len(got))
             if srcs[i] == 0 and any(b == bad for b, _, _ in web.pieces(int(curs[i])))]
    assert feeds, "the corrupted block was never used: the test would prove nothing"
    assert substituted[1] == substituted[2] == len(feeds)
    others = [i for i in range(len(got)) if i not in feeds]
    assert len(others) > len(feeds)
    # every row the bad block does not feed is exactly the clean run's (a loader that quarantined whole
    # batches, or shifted the stream, would differ here)
    changed = [i for i in others if not np.array_equal(got[i], clean[i])]
    assert not changed, f"rows {changed} do not read block {bad} but differ from the clean run"
    assert not _contains_run_of(got[feeds], corrupt_ds["original"])

    # each stand-in is the same position of source 0 in the first later epoch whose blocks are all clean,
    # read straight from the shards (an all-zero or other-source row fails this)
    def tokens(b: int) -> np.ndarray:
        sh, k = probe.store.refs[0][b]
        return sh.read_block(k).tokens.astype(np.int64)

    for i in feeds:
        k = int(curs[i])
        pieces = next(p for p in (web.pieces(k + j * web.n_seq) for j in range(1, 9))
                      if all(b != bad for b, _, _ in p))
        want = np.concatenate([tokens(b)[a:z] for b, a, z in pieces])
        assert len(want) == got.shape[1] and (want > 0).sum() > len(want) // 2
        assert np.array_equal(got[i], want), f"row {i} (web sequence {k}) is not its stand-in"
        assert not np.array_equal(got[i], clean[i])


def test_missing_shard_is_corruption_too(tmp_path, ld, loader_factory):
    import os

    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 200, "code": 100})
    probe = loader_factory(root)
    b = probe.orders[1].pieces(0)[0][0]
    sh, _ = probe.store.refs[1][b]
    os.unlink(sh.url)
    with pytest.raises(ShardError, match="missing"):
        ld.take(loader_factory(root), 12)
    q = loader_factory(root, corruption="quarantine")
    ld.take(q, 12)
    assert q.metrics()["quarantined_blocks"] >= 1
