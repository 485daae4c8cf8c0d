"""An objective from outside train/ (tests/train/toy_objective.py: label-smoothed cross entropy)
registers itself through the config's `imports`, and `train launch` trains two steps with it under real
torchrun: the logged first loss is the label-smoothed loss of the initial model on the first batch
(recomputed here in process), not the plain cross entropy that `pretrain` logs."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

from storage import config as cfgmod
from storage.config import ConfigError
from testutil import free_port, megatron_one_rank, run_killable

TRAIN = os.path.join(os.path.dirname(sys.executable), "train")
HERE = os.path.dirname(__file__)


def _config(tmp_path) -> dict:
    return {"run_dir": str(tmp_path / "run"), "steps": 2, "seed": 3, "objective": "label_smoothed_ce",
            "imports": ["toy_objective"],
            "model": {"preset": "tiny", "hidden_size": 64, "num_layers": 2, "ffn_hidden_size": 96, "vocab_size": 256},
            "parallel": {"micro_batch_size": 2, "global_batch_size": 4}, "data": {"seq_len": 32, "seed": 7},
            "debug": {"synthetic_data": True}, "monitor": {"log_every": 1, "tensorboard": False},
            "alerts": {"mfu_warn_below": 0.0}, "checkpoint": {"full_every": 0, "incremental_every": 0}}


def test_a_plugin_objective_trains_through_the_registry(tmp_path, monkeypatch):
    conf = tmp_path / "toy.yaml"
    conf.write_text(yaml.safe_dump(_config(tmp_path)))
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    rc = run_killable([TRAIN, "launch", str(conf), "--nproc", "1", "--set",
                       f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], tmp_path / "log", timeout=300, env=env)
    assert rc == 0, (tmp_path / "log").read_text()[-4000:]
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert len(losses) == 2

    monkeypatch.syspath_prepend(HERE)
    from train.config import TrainConfig
    from train.data import SyntheticLoader
    from train.model.gpt import build_model

    cfg = cfgmod.load(TrainConfig, str(conf), [])
    with megatron_one_rank(tmp_path):
        model = build_model(cfg.model, seed=cfg.seed)[0].eval()
        batch = next(SyntheticLoader(256, 32, 4, cfg.data.seed))
        tokens, labels = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            logits = model(tokens, torch.arange(32).expand_as(tokens), None).float().flatten(0, 1)
    smoothed = F.cross_entropy(logits, labels.flatten(), label_smoothing=0.1).item()
    plain = F.cross_entropy(logits, labels.flatten()).item()
    assert losses[0] == pytest.approx(smoothed, abs=1e-6) and abs(smoothed - plain) > 1e-4


def test_unknown_objective_and_import_are_config_errors(tmp_path):
    from train.config import TrainConfig

    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({**_config(tmp_path), "imports": [], "objective": "label_smoothing"}))
    with pytest.raises(ConfigError, match="key 'objective': unknown objective 'label_smoothing'; known: .*dpo.*pretrain.*sft"):
        cfgmod.load(TrainConfig, str(conf), [])
    with pytest.raises(ConfigError, match="key 'imports.0': cannot import 'no_such_plugin'"):
        cfgmod.load(TrainConfig, str(conf), ["imports=[no_such_plugin]"])
