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


def test_quarantine_skips_identically_on_all_ranks(corrupt_ds, loader_factory, ld):
    root, clean = corrupt_ds["root"], torch.cat(corrupt_ds["clean"])
    runs = {}
    for world in (1, 2):
        loaders = [loader_factory(root, rank=r, world=world, corruption="quarantine") for r in range(world)]
        runs[world] = torch.cat([torch.cat([next(x) for x in loaders]) for _ in range(12)])
        counted = [x.metrics()["quarantined_blocks"] for x in loaders]
        assert max(counted) == 1 and sum(x.metrics()["substituted_sequences"] for x in loaders) >= 1
    assert torch.equal(runs[1], runs[2]), "ranks must replace the same sequences with the same stand-ins"
    got = runs[1].numpy()
    replaced = [i for i in range(len(got)) if not np.array_equal(got[i], clean[i].numpy())]
    assert replaced, "the corrupted block was never used: the test would prove nothing"
    assert not _contains_run_of(got[replaced], corrupt_ds["original"])
    # the stand-ins are real sequences from the same source, not zeros
    assert all(got[i].max() // ld.SPAN == clean[i].max() // ld.SPAN and got[i].min() >= 0 for i in replaced)
    # rows that did not touch the bad block are exactly the clean ones
    assert all(np.array_equal(got[i], clean[i].numpy()) for i in range(len(got)) if i not in replaced)


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
