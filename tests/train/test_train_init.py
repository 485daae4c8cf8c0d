"""`train launch --init CHECKPOINT` through real torchrun/gloo runs: a run started from a TP2 checkpoint
runs at TP1 (resharded on load) from step 0 with a fresh optimizer and schedule and exactly the
checkpoint's weights; a relaunch of that run resumes from its own checkpoint instead of re-initialising."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import yaml

from testutil import free_port, metric_records, run_killable

pytestmark = pytest.mark.slow
TRAIN = os.path.join(os.path.dirname(sys.executable), "train")
MODEL = {"preset": "tiny", "hidden_size": 64, "num_layers": 2, "ffn_hidden_size": 96, "vocab_size": 256}


def _config(tmp_path, run_dir, model, **over) -> str:
    cfg = {"run_dir": str(run_dir), "steps": 2, "seed": 5, "model": model,
           "parallel": {"micro_batch_size": 2, "global_batch_size": 2},
           "data": {"seq_len": 32, "seed": 7}, "debug": {"synthetic_data": True},
           "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 1, "incremental_every": 0, "keep_last": 5, "keep_full_every": 0,
                          "async_save": False}, **over}
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _launch(args, log):
    rc = run_killable([TRAIN, "launch", *args, "--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], log,
                      timeout=300)
    assert rc == 0, open(log).read()[-5000:]


def _events(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" in r]


def test_init_from_tp2_checkpoint_at_tp1_then_resume_wins(tmp_path):
    from train.checkpoint.export_hf import load_model_tensors

    src = tmp_path / "src"
    _launch([_config(tmp_path, src, MODEL, parallel={"tp": 2, "micro_batch_size": 2, "global_batch_size": 2}),
             "--nproc", "2"], tmp_path / "src.log")
    src_ckpt = src / "checkpoints" / "step_00000002"
    assert json.loads((src_ckpt / "manifest.json").read_text())["layout"]["tp"] == 2

    # shape keys left null: taken from the checkpoint. Step 0's update is skipped (NaN loss), so the
    # checkpoint of step 1 holds exactly the weights the run started from.
    run = tmp_path / "sft"
    cfg = _config(tmp_path, run, {"preset": "tiny"}, steps=3, stop_at=2, debug={"synthetic_data": True,
                                                                                 "inject_nan_step": 0})
    _launch([cfg, "--nproc", "1", "--init", str(src)], tmp_path / "sft.log")
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["init"] == str(src_ckpt) and resolved["model"]["hidden_size"] == 64
    kinds = [e["event"] for e in _events(run)]
    assert "resume" not in kinds and kinds.index("init") < kinds.index("skip")
    recs = metric_records(run)
    assert [r["step"] for r in recs] == [1, 2] and recs[0]["consumed_tokens"] == 2 * 32  # step 0, fresh loader
    first = json.loads((run / "checkpoints" / "step_00000001" / "manifest.json").read_text())
    assert first["layout"]["tp"] == 1
    want, _ = load_model_tensors(str(src_ckpt))
    got, _ = load_model_tensors(str(run / "checkpoints" / "step_00000001"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert recs[0]["lr"] == metric_records(src)[0]["lr"]  # a fresh schedule (warmup step 0), not the source's

    # relaunch: the run has checkpoints, so it resumes at step 2 and does not load --init again
    _launch([cfg, "--nproc", "1", "--init", str(src), "--set", "stop_at=3"], tmp_path / "sft2.log")
    kinds = [(e["event"], e["step"]) for e in _events(run)]
    assert ("resume", 2) in kinds and [k for k, _ in kinds].count("init") == 1
    assert [r["step"] for r in metric_records(run)] == [1, 2, 3]
    diverged, _ = load_model_tensors(str(run / "checkpoints" / "step_00000003"))
    assert any(not torch.equal(diverged[k], want[k]) for k in want)  # it trained on from its own state
