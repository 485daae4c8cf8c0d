"""DALI backend (CPU mode) yields exactly the Python backend's sequences. The dev extra installs DALI on
Linux x86_64 (its only wheels): there it must be present (CI fails without it), elsewhere the tests skip."""
from __future__ import annotations

import platform

import pytest
import torch
from testutil import require

require("nvidia.dali", installed_here=platform.system() == "Linux" and platform.machine() == "x86_64")


def test_dali_backend_equals_python_backend(mixed_ds, loader_factory):
    py = loader_factory(mixed_ds, G=8, rank=1, world=2)
    dali = loader_factory(mixed_ds, G=8, rank=1, world=2, backend="dali")
    for _ in range(8):
        assert torch.equal(next(py), next(dali))
    assert dali.metrics()["blocks_read"] > 0


def test_dali_backend_reports_corruption_like_python(tmp_path, ld, loader_factory):
    from storage.shards import TAR_BLOCK, ShardError

    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 100})
    probe = loader_factory(root)
    sh, k = probe.store.refs[0][probe.orders[0].pieces(0)[0][0]]
    e = sh.index[k]
    with open(sh.url, "r+b") as f:
        f.seek(e.tokens_offset + TAR_BLOCK + 3)
        f.write(b"\xff\xff")
    with pytest.raises(ShardError, match=f"{e.key}.tokens.lz4"):
        [next(x) for x in [loader_factory(root, backend="dali")] for _ in range(4)]
