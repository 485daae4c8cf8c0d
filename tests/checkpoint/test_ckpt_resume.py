"""Real torchrun/gloo runs of a tiny megatron GPT with CheckpointManager: bit-exact resume from an
incremental checkpoint with the DistributedOptimizer, broken checkpoints skipped, the 0.16.1 step-sharing
fix, resharding. (kill -9 through `train launch`: test_ckpt_launch_kill.py.)"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from testutil import free_port

WORKER = os.path.join(os.path.dirname(__file__), "ckpt_worker.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
pytestmark = pytest.mark.slow


def run_worker(run_dir, steps, nproc=2, extra=(), env=None, check=True):
    os.makedirs(run_dir, exist_ok=True)
    trace = os.path.join(str(run_dir), f"trace-{os.urandom(4).hex()}.json")
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), WORKER,
           "--run-dir", str(run_dir), "--steps", str(steps), "--trace", trace, *extra]
    log = trace[:-5] + ".log"
    # Own session + output to a file: after a kill -9, megatron's helper processes (results-queue manager)
    # outlive the worker; they are ours to end, and must not hold a pipe open.
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        try:
            rc = p.wait(timeout=300)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if check:
        assert rc == 0, Path(log).read_text()[-8000:]
        with open(trace) as f:
            return json.load(f)
    return rc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted DP=2 run with the distributed optimizer: full every 4, incremental every 2. Rank 0
    enters each save 0.3 s late (the other rank is first in the folder: see test_no_overwriting_warning)."""
    run = tmp_path_factory.mktemp("ref")
    trace = run_worker(run, 10, extra=["--distopt"], env={"CKPT_WORKER_RANK0_SAVE_DELAY_S": "0.3"})
    assert trace["failed"] == []
    names = sorted(os.listdir(run / "ckpt"))
    assert names == ["latest", "step_00000002", "step_00000004", "step_00000006", "step_00000008",
                     "step_00000010"]
    return run, trace


def copy_run(src, dst, drop=()):
    shutil.copytree(src / "ckpt", dst / "ckpt")
    for name in drop:
        shutil.rmtree(dst / "ckpt" / name)


def assert_same_trace(got, ref, first):
    steps = sorted(int(s) for s in got["steps"])
    assert steps[0] == first and steps, got
    for s in steps:
        assert got["steps"][str(s)] == ref["steps"][str(s)], f"step {s} differs"


class RunsCode:
    """Pickles as a call of os.system: what a checkpoint from someone else could hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(ckpt: Path, rel: str, obj) -> None:
    """Replace a checkpoint file and its manifest entry, as whoever made the checkpoint could."""
    import torch
    import xxhash

    torch.save(obj, ckpt / rel)
    data = (ckpt / rel).read_bytes()
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"][rel] = {**m["files"][rel], "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    (ckpt / "manifest.json").write_text(json.dumps(m))


def test_resume_from_incremental_is_bit_exact_and_broken_ones_are_skipped(reference, tmp_path):
    """Skipped: a corrupted delta, a missing file, and pickles that would run code (train_state.pt, an RNG
    file; their manifests list them with the right checksums): never loaded, one line naming each."""
    ref_run, ref = reference
    copy_run(ref_run, tmp_path)
    ckpt = tmp_path / "ckpt"
    blob = ckpt / "step_00000010" / "delta" / "rank00000.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(data)
    (ckpt / "step_00000008" / "common.pt").unlink()
    marker = tmp_path / "code-ran"
    plant(ckpt / "step_00000010", "train_state.pt", {"step": 10, "extra": RunsCode(marker)})
    plant(ckpt / "step_00000008", "rng/rank00001.pt", {"python": RunsCode(marker)})
    got = run_worker(tmp_path, 10, extra=["--distopt", "--resume"])
    assert got["resumed"] and got["start"] == 6  # step_6 is incremental on step_4
    assert "step_00000010/delta/rank00000.bin: checksum mismatch" in got["skipped"][0]
    refusal = ": refused to load: it would call posix.system, which is neither a tensor nor plain data"
    assert f"step_00000010/train_state.pt{refusal}" in got["skipped"][0]
    assert "step_00000008/common.pt: file is missing" in got["skipped"][1]
    assert f"step_00000008/rng/rank00001.pt{refusal}" in got["skipped"][1]
    assert all("\n" not in msg for msg in got["skipped"])
    assert not marker.exists()
    assert_same_trace(got, ref, 7)  # loss, grad norm and loader position


def test_no_overwriting_warning_on_healthy_async_saves(reference, tmp_path):
    """megatron's save() checks on rank 0 alone that the folder is empty; rank 0 entered each of the 5
    saves 0.3 s after the other rank, which without train.checkpoint.save's rendezvous wrote its files
    into the folder first and made megatron warn "Overwriting old incomplete / corrupted checkpoint"."""
    _, ref = reference
    assert ref["megatron_warnings"] == [], ref["megatron_warnings"]
    # negative control: the same late rank 0 without the rendezvous (two saves: the first is immune) makes
    # megatron warn, and the worker's capture sees it
    got = run_worker(tmp_path, 4, extra=["--distopt"],
                     env={"CKPT_WORKER_RANK0_SAVE_DELAY_S": "0.3", "CKPT_WORKER_NO_RENDEZVOUS": "1"})
    assert any("Overwriting old incomplete" in w for w in got["megatron_warnings"]), got["megatron_warnings"]


def test_distopt_step_sharing_fix_matters(reference, tmp_path):
    """megatron-core 0.16.1 shares one AdamW step tensor between all parameters after a load: without
    our fix the resumed run drifts (this is the test that fails without the fix)."""
    ref_run, ref = reference
    copy_run(ref_run, tmp_path, drop=["step_00000008", "step_00000010"])
    got = run_worker(tmp_path, 8, extra=["--distopt", "--resume"],
                     env={"SMOLTRAIN_CKPT_DISABLE_DISTOPT_FIXES": "3"})
    assert got["start"] == 6
    assert got["steps"]["8"][0] != ref["steps"]["8"][0]


def test_reshard_dp2_to_tp2_to_pp2_and_dp1(reference, tmp_path):
    """Weights exact under another layout: the loss goes on as in the reference (fp32, same data)."""
    ref_run, ref = reference
    tp = tmp_path / "tp"
    copy_run(ref_run, tp, drop=["step_00000008", "step_00000010"])
    got = run_worker(tp, 8, extra=["--distopt", "--resume", "--tp", "2"])  # incremental step_6 → TP=2
    assert got["start"] == 6
    got2 = run_worker(tp, 10, extra=["--distopt", "--resume", "--pp", "2"])  # TP=2 step_8 → PP=2
    assert got2["start"] == 8
    dp1 = tmp_path / "dp1"
    copy_run(ref_run, dp1, drop=["step_00000010"])
    # DP=2 → DP=1; the background write of step_10 is made to fail: reported, never committed.
    got3 = run_worker(dp1, 10, nproc=1, extra=["--distopt", "--resume"],
                      env={"SMOLTRAIN_CKPT_FAIL_WRITE_AT_STEP": "10"})
    assert got3["start"] == 8
    assert len(got3["failed"]) == 1 and "step_00000010 (incremental) was NOT saved" in got3["failed"][0]
    assert not (dp1 / "ckpt" / "step_00000010").exists()
    assert (dp1 / "ckpt" / "latest").read_text().strip() == "step_00000008"
    for g in (got, got2, got3):
        for s, (loss, gnorm, consumed) in g["steps"].items():
            rloss, rgnorm, rconsumed = ref["steps"][s]
            assert consumed == rconsumed
            assert abs(loss - rloss) < 1e-5 and abs(gnorm - rgnorm) < 1e-3 * rgnorm, (s, loss, rloss)


@pytest.mark.gpu
def test_gpu_nccl_resume_from_incremental_is_exact(tmp_path):
    """The same worker on CUDA/NCCL (one process; deterministic kernels): resume from an incremental
    checkpoint reproduces the uninterrupted trace."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref = run_worker(tmp_path / "ref", 8, nproc=1, extra=["--distopt"])
    run = tmp_path / "run"
    copy_run(tmp_path / "ref", run, drop=["step_00000008"])
    got = run_worker(run, 8, nproc=1, extra=["--distopt", "--resume"])
    assert got["start"] == 6
    assert_same_trace(got, ref, 7)
