"""End to end through `train launch` (torchrun, 2 gloo processes, DistributedOptimizer, real shard
dataset): kill -9 the run at a random point, relaunch, and the loss / grad-norm / data trace after the
auto-resume is bit-identical to an uninterrupted run."""
from __future__ import annotations

import os
import random
import sys

import pytest
import yaml
from testutil import free_port, metric_records, run_killable, write_random_dataset

pytestmark = pytest.mark.slow
TRAIN = os.path.join(os.path.dirname(sys.executable), "train")


def _config(tmp_path, run_dir, dataset):
    cfg = {
        "run_dir": str(run_dir), "steps": 12, "seed": 1234, "precision": "fp32", "model": {"preset": "tiny"},
        "parallel": {"micro_batch_size": 2, "global_batch_size": 4, "distributed_optimizer": True},
        "data": {"dataset": dataset, "seq_len": 32, "seed": 7},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
        "monitor": {"log_every": 1, "tensorboard": False},
        "alerts": {"mfu_warn_below": 0.0},
        "checkpoint": {"full_every": 4, "incremental_every": 2, "keep_last": 3, "keep_full_every": 0},
    }
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(cfg_path, log_path, kill_when=None):
    """`train launch --nproc 2`; kill_when(): called while it runs, True → kill -9 the whole run."""
    return run_killable([TRAIN, "launch", str(cfg_path), "--nproc", "2",
                         "--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], log_path, kill_when, timeout=300)


_records = metric_records


def test_kill_9_and_auto_resume_is_bit_identical(tmp_path):
    dataset = str(tmp_path / "ds")
    write_random_dataset(dataset, {"web": 60, "code": 30}, vocab_size=1000)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    assert _launch(_config(tmp_path, ref_dir, dataset), tmp_path / "ref.log") == 0, (tmp_path / "ref.log").read_text()[-5000:]
    ref = {r["step"]: r for r in _records(ref_dir)}
    assert sorted(ref) == list(range(1, 13))

    kill_step = random.Random().randint(4, 8)
    print(f"kill -9 at the first save in flight at or after step {kill_step}")
    ckpt = run_dir / "checkpoints"

    def kill_when():
        recs = _records(run_dir)
        if not recs:
            return False
        step = recs[-1]["step"]
        writing = ckpt.exists() and any(n.startswith(".tmp-step") for n in os.listdir(ckpt))
        return (step >= kill_step and writing) or step >= kill_step + 3
    cfg = _config(tmp_path, run_dir, dataset)
    assert _launch(cfg, tmp_path / "run.log", kill_when) == "killed"
    mid_write = [n for n in os.listdir(ckpt) if n.startswith(".tmp-step")] if ckpt.exists() else []
    print(f"killed at step {_records(run_dir)[-1]['step']}; save in flight: {mid_write or 'none'}")
    before = len(_records(run_dir))
    assert _launch(cfg, tmp_path / "run.log") == 0, (tmp_path / "run.log").read_text()[-5000:]
    log = (tmp_path / "run.log").read_text()
    resumed = _records(run_dir)[before:]
    assert resumed and 0 < resumed[0]["step"] - 1 <= kill_step + 3, log[-3000:]
    for r in resumed:
        want = ref[r["step"]]
        assert (r["loss"], r["grad_norm"], r["consumed_tokens"]) == (want["loss"], want["grad_norm"],
                                                                     want["consumed_tokens"]), r["step"]
    assert resumed[-1]["step"] == 12
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]  # the interrupted save was cleaned up
