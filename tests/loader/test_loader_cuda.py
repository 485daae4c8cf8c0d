"""CUDA double buffering: batches arrive on the device, equal to the CPU stream (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory + side stream)")]


def test_cuda_batches_equal_cpu_batches(mixed_ds, loader_factory):
    cpu = [next(x) for x in [loader_factory(mixed_ds, G=8)] for _ in range(5)]
    dev = loader_factory(mixed_ds, G=8, device="cuda")
    for ref in cpu:
        got = next(dev)
        assert got.is_cuda and got.dtype == torch.int64
        assert torch.equal(got.cpu(), ref)
    assert dev.state_dict()["consumed"] == 5 * 8
