"""Plain-torch tests: delta encoding, region-wise delta application (resharding), atomic layout and
verification, retention, cadence, `train ckpt list|verify`."""
from __future__ import annotations

import contextlib
import json
import os

import fsspec
import pytest
import torch
from click.testing import CliRunner

from storage.config import ConfigError, from_dict
from train.checkpoint import CheckpointConfig, layout, retention
from train.checkpoint.cli import ckpt
from train.checkpoint.incremental import Piece, PieceSet, bits, decode, encode, write_deltas

LOCAL = fsspec.filesystem("file")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_delta_roundtrip_is_lossless(dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(33, 17, generator=g) * 5).to(dtype)
    new = base.clone()
    new[3:9] = ~base[3:9] if dtype == torch.bool else (torch.randn(6, 17, generator=g) * 5).to(dtype)
    nb, bb = bits(new), bits(base)
    codec, blob = encode(nb, bb)
    assert codec == "xor-zstd"
    assert (bb ^ decode(codec, blob, bb.dtype, nb.shape) == nb).all()
    assert encode(bb, bits(base.clone())) == ("same", b"")
    codec, blob = encode(nb, None)
    assert codec == "zstd" and (decode(codec, blob, nb.dtype, nb.shape) == nb).all()


def test_nan_and_negative_zero_survive_bitwise():
    base = torch.tensor([0.0, 1.0, float("nan"), -0.0])
    new = torch.tensor([-0.0, float("nan"), 1.0, 0.0])
    codec, blob = encode(bits(new), bits(base))
    got = torch.from_numpy(bits(base) ^ decode(codec, blob, bits(base).dtype, (4,))).view(torch.float32)
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
    with open(os.path.join(tmp, "common.pt"), "wb") as f:
        f.write(b"common")
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
from train import cpu_compat
cpu_compat.install()
import psutil, torch.distributed as dist
from train.checkpoint import CheckpointConfig, CheckpointManager

if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    CheckpointManager(CheckpointConfig(dir="c"), sys.argv[1])  # starts megatron's results-queue Manager
    print(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_helper_processes_die_with_a_killed_trainer(tmp_path):
    """megatron's async writer keeps a Manager process (spawned); a training process killed with SIGKILL
    must not leave it behind."""
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "trainer.py"
    script.write_text(_KILLED_TRAINER)
    # the helpers inherit stdout: read the pid line, not to EOF (which a surviving helper would hold off)
    with subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert proc.wait(timeout=120) == -9
    assert pids, "the trainer started no helper process: nothing to check"
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        if time.monotonic() > deadline:
            for p in pids:
                with contextlib.suppress(psutil.Error):
                    psutil.Process(p).kill()
            raise AssertionError(f"helper processes {pids} outlived the killed trainer")
        time.sleep(0.05)
