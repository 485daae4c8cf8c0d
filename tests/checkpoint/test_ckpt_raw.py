"""Raw full checkpoints: stream writer (O_DIRECT and buffered) hashes what it writes, pieces fill tensors
of another layout by region with full coverage, and an async save captures the state as it was when the
save started even though training changes it right after `before_update()`."""
from __future__ import annotations

import os

import fsspec
import numpy as np
import pytest
import torch
import torch.distributed as dist
import xxhash

from train.checkpoint import rawfile
from train.checkpoint.incremental import RAW_DIR, Piece, PieceSet, raw_snapshot, write_raw


@pytest.mark.parametrize("direct", [True, False])
def test_write_stream_writes_and_hashes_the_concatenation(tmp_path, monkeypatch, direct):
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT")  # the buffered + early writeback path
    monkeypatch.setattr(rawfile, "CHUNK", 1 << 16)  # many chunks, a partial last one
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 70_000, 0, 4096, 200_001, 13)]
    path = str(tmp_path / "x.bin")
    size, digest = rawfile.write_stream(path, [memoryview(p) for p in parts])
    whole = b"".join(p.tobytes() for p in parts)
    assert size == len(whole) == os.path.getsize(path)
    with open(path, "rb") as f:
        assert f.read() == whole
    assert digest == xxhash.xxh3_128_hexdigest(whole)


def test_raw_pieces_fill_another_layout_and_check_coverage(tmp_path):
    g = torch.Generator().manual_seed(1)
    whole = torch.randn(8, 6, generator=g)
    adam = torch.randn(8, 6, generator=g).to(torch.bfloat16)
    # written as two row halves (TP=2 style) by two ranks
    for rank in range(2):
        rows = slice(4 * rank, 4 * rank + 4)
        stats = write_raw(str(tmp_path), rank, [Piece("w", (8, 6), (4 * rank, 0), whole[rows].clone()),
                                                Piece("m", (8, 6), (4 * rank, 0), adam[rows].clone())])
        assert set(stats["files"]) == {f"{RAW_DIR}/rank{rank:05d}.bin", f"{RAW_DIR}/rank{rank:05d}.json"}
    pieces = PieceSet(str(tmp_path), RAW_DIR)
    # read back as column halves (another layout)
    for c in range(2):
        t = torch.zeros(8, 3)
        pieces.apply("w", (0, 3 * c), t)
        assert pieces.elements == t.numel()
        assert torch.equal(t, whole[:, 3 * c:3 * c + 3])
    t = torch.zeros(8, 6, dtype=torch.bfloat16)
    pieces.apply("m", (0, 0), t)
    assert torch.equal(t, adam)
    pieces.apply("w", (8, 0), torch.zeros(2, 6))  # outside every piece
    assert pieces.elements == 0
    snap = raw_snapshot(str(tmp_path), 1)
    assert np.array_equal(snap[("w", (4, 0), (4, 6))], whole[4:].view(torch.int32).numpy())


class _Model:
    def __init__(self, n: int):
        self.w = torch.nn.Parameter(torch.arange(n, dtype=torch.float32))

    def sharded_state_dict(self):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        return {"w": ShardedTensor.from_rank_offsets("w", self.w.data)}

    def load_state_dict(self, sd, strict=True):
        self.w.data.copy_(sd["w"])


def test_async_save_keeps_the_values_of_its_step_after_before_update(tmp_path):
    from train.checkpoint import CheckpointConfig, CheckpointManager
    from train.checkpoint.resume import load_into
    from train.state import TrainState

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _Model(8 << 20)  # 32 MiB: the background copy takes a while
        state = TrainState(model=[model], optimizer=None, scheduler=None, loader=None)
        mgr = CheckpointManager(CheckpointConfig(dir="c", full_every=1, incremental_every=0), str(tmp_path))
        state.step = 1
        want = model.w.detach().clone()
        mgr.maybe_save(state)
        mgr.before_update()
        assert mgr.saver.pending is None or mgr.saver.pending.staging.done()
        with torch.no_grad():
            model.w.add_(1.0)  # the optimizer step
        mgr.close()
        model.w.data.zero_()
        load_into(state, mgr.root, "step_00000001", mgr.cfg)
        assert torch.equal(model.w.detach(), want)
    finally:
        dist.destroy_process_group()


def test_retired_tensor_files_are_overwritten_by_later_saves(tmp_path):
    """Retention keeps a deleted checkpoint's tensor file for reuse: the next full save overwrites it in
    place (same inode, cut to the new size), and what it holds then verifies and loads exactly."""
    from train.checkpoint import CheckpointConfig, CheckpointManager, layout
    from train.checkpoint.incremental import RECYCLE_DIR
    from train.checkpoint.resume import load_into
    from train.state import TrainState

    fs = fsspec.filesystem("file")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _Model(1 << 16)
        state = TrainState(model=[model], optimizer=None, scheduler=None, loader=None)
        mgr = CheckpointManager(CheckpointConfig(dir="c", full_every=1, incremental_every=0, keep_last=1,
                                                 async_save=False), str(tmp_path))
        inode = {}
        for step in (1, 2, 3):
            with torch.no_grad():
                model.w.add_(step)
            state.step = step
            mgr.maybe_save(state)
            inode[step] = os.stat(os.path.join(mgr.root, f"step_{step:08d}", RAW_DIR, "rank00000.bin")).st_ino
            assert [c.name for c in layout.list_checkpoints(fs, mgr.root)] == [f"step_{step:08d}"]
        assert inode[3] == inode[1] and inode[2] != inode[1]  # 1 retired by 2's commit, reused by 3
        assert len(os.listdir(os.path.join(mgr.root, RECYCLE_DIR))) == 1  # 2's file, waiting for save 4
        want = model.w.detach().clone()
        mgr.close()
        assert layout.verify(fs, mgr.root, "step_00000003", checksums=True) == []
        model.w.data.zero_()
        load_into(state, mgr.root, "step_00000003", mgr.cfg)
        assert torch.equal(model.w.detach(), want)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("direct", [True, False])
def test_write_stream_places_parts_at_aligned_offsets_and_writes_them_from_memory(tmp_path, monkeypatch, direct):
    """Parts at offsets congruent to their addresses (aligned_offsets) land where the offsets say, with
    zeros between them; the digest covers the whole file; big parts take the straight-from-memory path."""
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT")
    monkeypatch.setattr(rawfile, "CHUNK", 1 << 16)
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    parts = [base[3:3 + 300_001], base[400_000:400_000 + 5], np.zeros(0, np.uint8), base[500_123:900_000],
             rng.integers(0, 256, 70_000, dtype=np.uint8)]
    views = [memoryview(p) for p in parts]
    offsets = rawfile.aligned_offsets(views)
    assert all((o - p.ctypes.data) % 4096 == 0 for o, p in zip(offsets, parts) if len(p))
    calls = []
    real = rawfile._pwrite_all
    monkeypatch.setattr(rawfile, "_pwrite_all", lambda fd, buf, off: (calls.append(buf), real(fd, buf, off)))
    path = str(tmp_path / "y.bin")
    size, digest = rawfile.write_stream(path, views, offsets)
    want = bytearray(offsets[-1] + len(parts[-1]))
    for o, p in zip(offsets, parts):
        want[o:o + len(p)] = p.tobytes()
    with open(path, "rb") as f:
        assert f.read() == bytes(want)
    assert size == len(want) and digest == xxhash.xxh3_128_hexdigest(bytes(want))
    from_memory = [c for c in calls if np.frombuffer(c, np.uint8).ctypes.data in
                   range(base.ctypes.data, base.ctypes.data + base.nbytes)]
    assert bool(from_memory) == direct  # only O_DIRECT skips the bounce copy
