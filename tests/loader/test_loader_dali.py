"""DALI backend (CPU mode) yields exactly the Python backend's sequences (skipped without DALI)."""
from __future__ import annotations

import pytest
import torch

from storage.loader.dali import dali_available

pytestmark = pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI not installed (pip install '.[dali]')")


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
