"""Plain-torch tests: delta encoding, region-wise delta application (resharding), atomic layout and
verification, retention, cadence, `train ckpt list|verify`."""
from __future__ import annotations

import contextlib
import json
import os
import pickle

import fsspec
import numpy as np
import pytest
import torch
import zstandard
from click.testing import CliRunner

from storage.config import ConfigError, from_dict
from train.checkpoint import CheckpointConfig, layout, retention
from train.checkpoint.cli import ckpt
from train.checkpoint.incremental import Piece, PieceSet, write_deltas
from train.checkpoint.planes import bits, decode, encode

LOCAL = fsspec.filesystem("file")


def _roundtrip(new: np.ndarray, base: np.ndarray | None) -> tuple[str, list, np.ndarray | None]:
    codec, records, bufs = encode(new, base)
    e = {"key": "t", "codec": codec, "shape": list(new.shape), "chunks": records}
    return codec, records, decode(e, b"".join(bytes(b) for b in bufs), new.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_delta_roundtrip_is_lossless(dtype, monkeypatch):
    from train.checkpoint import planes

    monkeypatch.setattr(planes, "CHUNK_ELEMS", 128)  # 5 chunks; the first one unchanged
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(33, 17, generator=g) * 5).to(dtype)
    new = base.clone()
    new[9:20] = ~base[9:20] if dtype == torch.bool else (torch.randn(11, 17, generator=g) * 5).to(dtype)
    nb, bb = bits(new), bits(base)
    codec, records, d = _roundtrip(nb, bb)
    assert codec == "xor-planes" and [r[0] for r in records] == [128, 128, 128, 128, 49]
    assert records[0][1] == "same" and records[1][1] != "same" and len(records[1]) == 1 + nb.itemsize
    assert (bb ^ d == nb).all()
    assert encode(bb, bits(base.clone()))[0] == "same"
    codec, _, d = _roundtrip(nb, None)
    assert codec == "planes" and (d == nb).all()


def test_planes_that_do_not_shrink_are_stored_raw_and_old_deltas_still_decode():
    rng = np.random.default_rng(0)
    base = rng.standard_normal(1 << 19).astype(np.float32)  # 2 MiB: planes over the sample size
    new = base * np.float32(1.001) + rng.standard_normal(len(base)).astype(np.float32) * np.float32(1e-3)
    nb, bb = new.view(np.int32), base.view(np.int32)
    codec, records, d = _roundtrip(nb, bb)
    (n, *planes), = records
    assert [m for m, _ in planes[:2]] == ["raw", "raw"] and planes[3][0] == "zstd"  # random low bytes, exponents
    assert planes[3][1] < 0.5 * n and (bb ^ d == nb).all()
    # incremental checkpoints written before byte planes: zstd of the whole byte-shuffled XOR pattern
    x = nb ^ bb
    old = zstandard.ZstdCompressor(level=3).compress(np.ascontiguousarray(x.view(np.uint8).reshape(-1, 4).T).tobytes())
    assert (decode({"key": "t", "codec": "xor-zstd", "shape": [len(x)]}, old, np.int32) == x).all()


def test_nan_and_negative_zero_survive_bitwise():
    base = torch.tensor([0.0, 1.0, float("nan"), -0.0])
    new = torch.tensor([-0.0, float("nan"), 1.0, 0.0])
    _, _, d = _roundtrip(bits(new), bits(base))
    got = torch.from_numpy(bits(base) ^ d).view(torch.float32)
    assert torch.equal(got.view(torch.int32), new.view(torch.int32))


def _pieces(t: torch.Tensor, key: str, parts: int, dim: int, stacked: int | None = None) -> list[Piece]:
    """Split a global tensor into `parts` along `dim` like TP ranks hold it (optionally one stacked layer)."""
    out, off = [], 0
    for chunk in t.chunk(parts, dim=dim):
        offset = [0] * t.dim()
        offset[dim] = off
        off += chunk.shape[dim]
        if stacked is not None:  # megatron: local piece without the leading layer axis
            out.append(Piece(key, (4, *t.shape), (stacked, *offset), chunk.clone()))
        else:
            out.append(Piece(key, tuple(t.shape), tuple(offset), chunk.clone()))
    return out


def test_deltas_written_under_one_split_apply_under_another(tmp_path):
    g = torch.Generator().manual_seed(1)
    base_full = torch.randn(8, 6, generator=g)
    new_full = base_full + torch.randn(8, 6, generator=g) * 1e-3
    new_full[0, 0] = base_full[0, 0]
    # Written by 2 "TP ranks" split on dim 0, with their base pieces in memory.
    writers = _pieces(new_full, "w", 2, 0)
    base_pieces = _pieces(base_full, "w", 2, 0)
    for rank, (p, b) in enumerate(zip(writers, base_pieces)):
        stats = write_deltas(str(tmp_path), rank, [p], {b.ident: bits(b.tensor)})
        assert stats["written"] < stats["full"]
    deltas = PieceSet(str(tmp_path))
    # Applied under 3 ranks split on dim 1, and to the whole tensor (export).
    for piece in _pieces(base_full, "w", 3, 1):
        target = piece.tensor.clone()
        assert deltas.apply("w", piece.global_offset, target) == 2
        sl = slice(piece.global_offset[1], piece.global_offset[1] + target.shape[1])
        assert torch.equal(target, new_full[:, sl])
    whole = base_full.clone()
    deltas.apply("w", (0, 0), whole)
    assert torch.equal(whole, new_full)


def test_stacked_layer_pieces_apply_to_whole_tensor(tmp_path):
    base = torch.randn(4, 5, 3)
    new = base * 1.5
    pieces = [p for layer in range(4) for p in _pieces(new[layer], "L", 1, 0, stacked=layer)]
    basemap = {p.ident: bits(base[p.global_offset[0]]) for p in pieces}
    write_deltas(str(tmp_path), 0, pieces, basemap)
    whole = base.clone()
    assert PieceSet(str(tmp_path)).apply("L", (0, 0, 0), whole) == 4
    assert torch.equal(whole, new)


def _fake_ckpt(root, step, kind="full", base=None, payload=b"x" * 1000):
    tmp = layout.tmp_dir_for(str(root), step)
    os.makedirs(os.path.join(tmp, "sub"))
    with open(os.path.join(tmp, "sub", "data.bin"), "wb") as f:
        f.write(payload + bytes([step % 256]))
    torch.save({"common": step}, os.path.join(tmp, "common.pt"))
    return layout.commit(tmp, str(root), step, kind, base, {"tensor_bytes": {"written": 10, "full": 40}})


def test_commit_is_atomic_and_verify_finds_flips_truncation_and_missing_files(tmp_path):
    _fake_ckpt(tmp_path, 2)
    _fake_ckpt(tmp_path, 4, "incremental", "step_00000002")
    assert layout.read_latest(LOCAL, str(tmp_path)) == "step_00000004"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    m = json.loads((tmp_path / "step_00000004" / "manifest.json").read_text())
    assert m["files"]["sub/data.bin"]["size"] == 1001 and len(m["files"]["sub/data.bin"]["xxh3_128"]) == 32
    assert layout.verify(LOCAL, str(tmp_path), "step_00000004") == []
    data = tmp_path / "step_00000002" / "sub" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[500] ^= 0x10
    data.write_bytes(raw)
    problems = layout.verify(LOCAL, str(tmp_path), "step_00000004")
    assert problems == [(f"{tmp_path}/step_00000004: base step_00000002 does not verify: "
                        f"{tmp_path}/step_00000002/sub/data.bin: checksum mismatch (corrupted)")]
    assert layout.verify(LOCAL, str(tmp_path), "step_00000004", checksums=False) == []
    data.write_bytes(raw[:100])
    assert "truncated" in layout.verify(LOCAL, str(tmp_path), "step_00000002")[0]
    (tmp_path / "step_00000004" / "common.pt").unlink()
    assert "common.pt: file is missing" in layout.verify(LOCAL, str(tmp_path), "step_00000004", chain=False)[0]
    (tmp_path / "step_00000004" / "manifest.json").write_text("{trunc")
    assert "not valid JSON" in layout.verify(LOCAL, str(tmp_path), "step_00000004")[0]


class RunsCode:
    """Pickles as a call of os.system (the files of a checkpoint from someone else could hold one)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_checkpoint_pickles_load_without_running_code(tmp_path):
    """train_state.pt / rng files / megatron's common.pt (safe_load.load_torch, layout.verify) and
    torch_dist's .metadata and bytes items (safe_load.install) refuse a pickle that would run code, with
    one line naming the file; real ones (an RNG file of the old format too) load."""
    import random

    import numpy as np
    import torch.distributed.checkpoint as dcp

    from train.checkpoint import safe_load, state_io

    marker = tmp_path / "code-ran"
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save(state_io.rng_state(), tmp_path / "rng.pt")
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    state_io.set_rng_state(safe_load.load_torch(str(tmp_path / "rng.pt")))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    old = {**state_io.rng_state(), "numpy": np.random.get_state()}  # before RNG files held tensors
    torch.save(old, tmp_path / "old.pt")
    np.testing.assert_array_equal(safe_load.load_torch(str(tmp_path / "old.pt"))["numpy"][1], old["numpy"][1])
    torch.save({"step": 3, "extra": RunsCode(marker)}, tmp_path / "train_state.pt")
    with pytest.raises(layout.CheckpointError) as e:
        safe_load.load_torch(str(tmp_path / "train_state.pt"))
    assert str(e.value) == (f"{tmp_path}/train_state.pt: refused to load: it would call posix.system, which is "
                            "neither a tensor nor plain data")
    # verify reports it (resume then skips the checkpoint), whatever the manifest's checksums say
    ckpt = tmp_path / "ckpts"
    _fake_ckpt(ckpt, 2)
    tmp = layout.tmp_dir_for(str(ckpt), 4)
    os.makedirs(os.path.join(tmp, "rng"))
    torch.save({"python": RunsCode(marker)}, os.path.join(tmp, "rng", "rank00001.pt"))
    torch.save({"common": 4}, os.path.join(tmp, "common.pt"))
    layout.commit(tmp, str(ckpt), 4, "full", None, {})
    assert layout.verify(LOCAL, str(ckpt), "step_00000002") == []
    assert layout.verify(LOCAL, str(ckpt), "step_00000004") == [
        f"{ckpt}/step_00000004/rng/rank00001.pt: refused to load: it would call posix.system, which is neither a "
        "tensor nor plain data"]
    # torch_dist (torch.distributed.checkpoint): a sharded object is a bytes item of a .distcp file, read by
    # torch with weights_only=False; the .metadata is a plain pickle
    safe_load.install()
    dcp.save({"w": torch.arange(4.0), "obj": "hello"}, checkpoint_id=str(tmp_path / "dcp"))
    got = {"w": torch.zeros(4), "obj": None}
    dcp.load(got, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(got["w"], torch.arange(4.0)) and got["obj"] == "hello"
    dcp.save({"w": torch.arange(4.0), "obj": RunsCode(marker)}, checkpoint_id=str(tmp_path / "evil"))
    with pytest.raises(dcp.api.CheckpointException) as e:
        dcp.load({"w": torch.zeros(4), "obj": None}, checkpoint_id=str(tmp_path / "evil"))
    failure = e.value.failures[0][0]  # torch collects (exception, traceback) per rank
    assert isinstance(failure, layout.CheckpointError)
    assert str(failure) == ("bytes item obj: refused to load: it would call posix.system, which is neither a "
                            "tensor nor plain data")
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(dcp.api.CheckpointException) as e:
        dcp.load(got, checkpoint_id=str(tmp_path / "dcp"))
    assert f"{tmp_path}/dcp/.metadata: refused to load: it would call posix.system" in str(e.value.failures[0][0])
    assert not marker.exists()


def test_stale_tmp_folders_are_removed(tmp_path, caplog):
    """What CheckpointManager does at start-up (rank 0): an interrupted save's folder is removed and counted."""
    from storage import atomic

    os.makedirs(tmp_path / ".tmp-step_00000006" / "x")
    _fake_ckpt(tmp_path, 2)
    assert atomic.sweep(str(tmp_path)) == 1
    assert f"removed 1 stale temporary folder from an interrupted run: {tmp_path}/.tmp-step_00000006" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002"]


class C:
    def __init__(self, step, kind, base=None):
        self.name, self.step, self.kind, self.base = layout.ckpt_name(step), step, kind, base


def test_retention_keeps_last_k_every_kth_full_and_chain_bases():
    # full every 10, incremental every 2; K=2 → steps 20, 40 kept forever
    ckpts = []
    for s in range(2, 52, 2):
        full = s % 10 == 0
        ckpts.append(C(s, "full" if full else "incremental", None if full else layout.ckpt_name(s // 10 * 10)
                       if s > 10 else None))
    ckpts = [c for c in ckpts if c.kind == "full" or c.base]
    keep = retention.keep_set(ckpts, keep_last=3, full_every=10, keep_full_every=2)
    assert keep == {"step_00000020", "step_00000040", "step_00000046", "step_00000048", "step_00000050"}
    keep = retention.keep_set(ckpts[:-1], keep_last=2, full_every=10, keep_full_every=0)
    assert keep == {"step_00000046", "step_00000048", "step_00000040"}  # base of the kept incrementals
    assert "step_00000010" in retention.to_delete(ckpts, 2, 10, 0)


def test_config_cadence_and_validation():
    cfg = from_dict(CheckpointConfig, {"full_every": 10, "incremental_every": 4})
    assert [cfg.kind_at(s) for s in (0, 4, 8, 10, 12, 20)] == [None, "incremental", "incremental", "full",
                                                                "incremental", "full"]
    with pytest.raises(ConfigError, match="keep_last"):
        from_dict(CheckpointConfig, {"keep_last": 0})
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(CheckpointConfig, {"every": 3})


def test_cli_list_and_verify(tmp_path):
    _fake_ckpt(tmp_path, 2)
    _fake_ckpt(tmp_path, 4, "incremental", "step_00000002")
    os.makedirs(tmp_path / "step_00000006")  # a folder without manifest: broken
    r = CliRunner().invoke(ckpt, ["list", str(tmp_path)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "incremental" in lines[2] and "25.0%" in lines[2] and "latest" in lines[2]
    assert "BROKEN" in lines[3]
    r = CliRunner().invoke(ckpt, ["verify", str(tmp_path), "step_00000002", "step_00000004"])
    assert r.exit_code == 0 and r.output.count("ok") == 2
    r = CliRunner().invoke(ckpt, ["verify", str(tmp_path)])
    assert r.exit_code == 1 and "FAIL step_00000006" in r.output and "manifest.json is missing" in r.output


_KILLED_TRAINER = """
import os, signal, sys
from train.model import cpu_compat
cpu_compat.install()
import psutil, torch.distributed as dist
from train.checkpoint import CheckpointConfig, CheckpointManager

if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # fully_sharded_model_space is saved by torch_dist: the manager starts megatron's results-queue Manager
    CheckpointManager(CheckpointConfig(dir="c", distrib_optim_sharding_type=sys.argv[2]), sys.argv[1])
    print(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_helper_processes_die_with_a_killed_trainer(tmp_path):
    """megatron's torch_dist writer keeps a Manager process (spawned); a training process killed with SIGKILL
    must not leave it behind. A format that never saves through torch_dist starts no such process."""
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "trainer.py"
    script.write_text(_KILLED_TRAINER)

    def helpers(sharding: str) -> list[int]:
        # the helpers inherit stdout: read the pid line, not to EOF (which a surviving helper would hold off)
        with subprocess.Popen([sys.executable, str(script), str(tmp_path), sharding], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) as proc:
            pids = [int(p) for p in proc.stdout.readline().split()]
            assert proc.wait(timeout=120) == -9
        return pids

    assert helpers("fully_reshardable") == []
    pids = helpers("fully_sharded_model_space")
    assert pids, "the trainer started no helper process: nothing to check"
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        if time.monotonic() > deadline:
            for p in pids:
                with contextlib.suppress(psutil.Error):
                    psutil.Process(p).kill()
            raise AssertionError(f"helper processes {pids} outlived the killed trainer")
        time.sleep(0.05)
