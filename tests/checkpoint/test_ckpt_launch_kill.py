"""End to end through `train launch` (torchrun, 2 gloo processes, DistributedOptimizer, real shard
dataset): kill -9 the run while an async checkpoint save is in flight (the save of a step drawn from a
seeded RNG), relaunch, and the loss / grad-norm / data trace after the auto-resume is bit-identical to an
uninterrupted run, and so is the whole run folder, hidden files included (tools.outtree): the interrupted
save's temporary folder was removed, counted, and saved again. The uninterrupted run's console is also
checked to be clean (train.monitor.console)."""
from __future__ import annotations

import os
import random
import sys

import pytest
import yaml
from testutil import metric_records, run_killable, write_random_dataset

from tools.outtree import TRAIN_VOLATILE, differences, tree

pytestmark = pytest.mark.slow
TRAIN = os.path.join(os.path.dirname(sys.executable), "train")
SEED = 20  # the kill point is drawn from it: a failure replays the same way


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
    """`train launch --nproc 2` (standalone: torchrun picks a free port); kill_when(): called while it runs,
    True → kill -9 the whole run."""
    return run_killable([TRAIN, "launch", str(cfg_path), "--nproc", "2"], log_path, kill_when, timeout=300)


_records = metric_records


def _assert_clean_console(console: str, run_dir) -> None:
    """A clean console (train.monitor.console): megatron's import warnings went to each rank's log file, the one
    setup line says what they amount to, and none of the 6 async saves (2 ranks) made megatron think it
    overwrote an old checkpoint (the race fixed in train.checkpoint.save._after_empty_check)."""
    assert "UserWarning" not in console and "warnings.warn(" not in console, console[-3000:]
    assert console.count("[setup] Transformer Engine not installed") == 1, console[-3000:]
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("rank*.log")}
    assert sorted(logs) == ["rank0.log", "rank1.log"], sorted(logs)
    assert all("Transformer Engine and Apex are not installed" in t for t in logs.values())
    assert "committed" in logs["rank0.log"]  # our checkpoint INFO lines land in the file
    for text in [console, *logs.values()]:
        assert "Overwriting old incomplete" not in text


def test_kill_9_and_auto_resume_is_bit_identical(tmp_path):
    dataset = str(tmp_path / "ds")
    write_random_dataset(dataset, {"web": 60, "code": 30}, vocab_size=1000)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    assert _launch(_config(tmp_path, ref_dir, dataset), tmp_path / "ref.log") == 0, (tmp_path / "ref.log").read_text()[-5000:]
    ref = {r["step"]: r for r in _records(ref_dir)}
    assert sorted(ref) == list(range(1, 13))
    _assert_clean_console((tmp_path / "ref.log").read_text(), ref_dir)

    # saves every 2 steps (incremental_every 2, full_every 4): kill during the save of the first saved step
    # at or after a step drawn from the seed, while its folder is still .tmp-step_* (written, not committed)
    kill_step = random.Random(SEED).randint(4, 8)
    save_step = kill_step + kill_step % 2
    in_flight = f".tmp-step_{save_step:08d}"
    print(f"seed {SEED}: kill -9 while the save of step {save_step} is in flight")
    ckpt = run_dir / "checkpoints"
    cfg = _config(tmp_path, run_dir, dataset)
    killed = _launch(cfg, tmp_path / "run.log", lambda: ckpt.exists() and in_flight in os.listdir(ckpt))
    assert killed == "killed", f"the save of step {save_step} was never seen in flight: {killed}"
    # the kill landed mid-save: the save's folder was never committed (renamed), nothing later was saved
    assert (ckpt / in_flight).is_dir() and not (ckpt / f"step_{save_step:08d}").exists(), sorted(os.listdir(ckpt))
    assert not [n for n in os.listdir(ckpt) if n.startswith("step_") and int(n[5:]) > save_step]
    print(f"killed at step {_records(run_dir)[-1]['step']}; in flight: "
          f"{sorted(n for n in os.listdir(ckpt) if n.startswith('.tmp-step'))}")
    before = len(_records(run_dir))
    assert _launch(cfg, tmp_path / "run.log") == 0, (tmp_path / "run.log").read_text()[-5000:]
    log = (tmp_path / "run.log").read_text()
    resumed = _records(run_dir)[before:]
    # the relaunch dropped the interrupted save and resumed from a committed checkpoint before it
    removed = [ln for ln in log.splitlines() if "stale temporary folder" in ln and "from an interrupted run" in ln]
    assert removed and in_flight in removed[-1], log[-3000:]  # (with the previous save's, if it was committing)
    assert resumed and 0 < resumed[0]["step"] - 1 < save_step, log[-3000:]
    assert f"resumed at step {resumed[0]['step'] - 1}" in log
    for r in resumed:
        want = ref[r["step"]]
        assert (r["loss"], r["grad_norm"], r["consumed_tokens"]) == (want["loss"], want["grad_norm"],
                                                                     want["consumed_tokens"]), r["step"]
    assert resumed[-1]["step"] == 12
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]  # the interrupted save was cleaned up
    assert differences(tree(str(ref_dir), TRAIN_VOLATILE), tree(str(run_dir), TRAIN_VOLATILE)) == []
