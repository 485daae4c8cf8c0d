"""Online RL (objective grpo, rloo, ppo) under real torchrun on a `format: prompts` dataset of arithmetic
questions, starting from the tiny Llama of tests/train/conftest.py imported as a checkpoint, with a reward
function of tests/train/rl_rewards.py named in the config: a PPO run (value head, GAE, KL to the reference,
entropy bonus) killed with kill -9 resumes (from its checkpoint, not from the start) bit-identically (rewards,
losses, gradient norms, final weights and critic); config errors are one line naming the key."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from testutil import free_port, metric_records, run_killable

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def setup(tiny_hf, tiny_ckpt, tmp_path_factory) -> dict:
    from datapipe.demo import arithmetic_prompts

    tmp = tmp_path_factory.mktemp("rl")
    log = tmp / "log.txt"
    (tmp / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arithmetic_prompts(120, seed=2)))
    build = {"output": str(tmp / "ds"), "tokenizer": {"path": str(Path(tiny_hf[4]) / "tokenizer.json")},
             "validation": {"fraction": 0.2},
             "sources": [{"name": "arith", "paths": [str(tmp / "arith.jsonl")], "format": "prompts",
                          "chat": {"template": "chatml", "max_tokens": 48}}]}
    (tmp / "build.yaml").write_text(yaml.safe_dump(build))
    assert run_killable([str(BIN / "datapipe"), "build", "--quiet", str(tmp / "build.yaml")], log) == 0, \
        log.read_text()[-3000:]
    return {"tmp": tmp, "log": log, "ds": tmp / "ds", "policy": tiny_ckpt}


def _config(setup, name: str, **over) -> Path:
    cfg = {"run_dir": str(setup["tmp"] / name), "objective": "ppo", "steps": 6, "seed": 4,
           "imports": ["rl_rewards"],
           "model": {"preset": "tiny"}, "data": {"dataset": str(setup["ds"]), "seq_len": 64, "seed": 1},
           "parallel": {"global_batch_size": 4, "micro_batch_size": 2},
           "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
           "rl": {"group_size": 4, "max_new_tokens": 8, "kl_coef": 0.05, "entropy_coef": 0.01, "eval_prompts": 8,
                  "rewards": [{"name": "rl_rewards:length_reward"}, {"name": "math", "weight": 2.0}]},
           "eval": {"every": 3, "tasks": [], "validation_tokens": 0},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 2, "incremental_every": 0, "async_save": False}}
    for k, v in over.items():
        node = cfg
        *path, last = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    path = setup["tmp"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(setup, conf: Path, kill_when=None):
    env = {"PYTHONPATH": str(HERE)}
    rc = run_killable([str(BIN / "train"), "launch", str(conf), "--nproc", "1", "--init", str(setup["policy"]),
                       "--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], setup["log"], env=env,
                      kill_when=kill_when, timeout=400)
    assert rc == ("killed" if kill_when else 0), setup["log"].read_text()[-4000:]


def _trace(run: Path) -> dict:
    return {r["step"]: (r["loss"], r["grad_norm"], r["reward"], r["kl"], r["entropy"]) for r in metric_records(run)}


def test_ppo_kill_9_resumes_bit_identically(setup):
    """PPO exercises the whole loop (rollouts, rewards, the frozen reference, the value head, GAE) and its
    checkpointed critic; GRPO's loop is the same code without the critic (and runs end to end in the demo
    test)."""
    from train.checkpoint.export_hf import load_model_tensors
    from train.checkpoint.incremental import RAW_DIR, PieceSet

    _launch(setup, _config(setup, "full"))
    full = _trace(setup["tmp"] / "full")
    assert sorted(full) == list(range(1, 7))
    assert any(abs(v[1]) > 0 for v in full.values()) and any(v[3] != 0 for v in full.values())  # it learns, KL acts
    recs = metric_records(setup["tmp"] / "full")
    assert {"reward_std", "clip_fraction", "logp_mismatch", "response_length", "generation_s", "update_s",
            "value_loss", "reward/length_reward", "reward/math_reward"} <= set(recs[-1])
    assert all(r["value_loss"] > 0 for r in recs)
    assert recs[-1]["logp_mismatch"] < 1e-3  # the engine's log-probs and the trainer's agree
    evals = [json.loads(ln) for ln in (setup["tmp"] / "full" / "metrics.jsonl").read_text().splitlines()
             if '"kind": "eval"' in ln]
    assert [e["step"] for e in evals] == [0, 3, 6] and all(e["rl_val/prompts"] == 8 for e in evals)

    conf = _config(setup, "killed")
    ckpts = setup["tmp"] / "killed" / "checkpoints"
    _launch(setup, conf, kill_when=lambda: (ckpts / "latest").exists() and
            (ckpts / "latest").read_text().strip() == "step_00000004")
    _launch(setup, conf)
    # the rerun resumed from step 4 (a rerun that ignored its checkpoints would give the same trace)
    lines = (setup["tmp"] / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines if '"event": "resume"' in ln] == [4]
    assert [r["step"] for r in metric_records(setup["tmp"] / "killed")].count(1) == 1
    assert _trace(setup["tmp"] / "killed") == full
    a, _ = load_model_tensors(str(sorted((setup["tmp"] / "full" / "checkpoints").glob("step_*"))[-1]))
    last = sorted(ckpts.glob("step_*"))[-1]
    b, _ = load_model_tensors(str(last))
    assert all(torch.equal(a[k], b[k]) for k in a) and "value_head.weight" in a  # the critic too
    assert "value_head.weight" in PieceSet(str(last), RAW_DIR).keys()


def test_config_errors_name_the_key(setup):
    cases = [({"objective": "grpo", "rl.group_size": 1}, "key 'rl.group_size': grpo compares completions of one prompt"),
             ({"rl.rewards": [{"name": "nosuch"}]}, "key 'rl.rewards.0.name': unknown reward 'nosuch'"),
             ({"rl.rewards": [{"name": "rl_rewards:missing_fn"}]}, "key 'rl.rewards.0.name': cannot load reward"),
             ({"rl.rewards": [{"name": "format"}]}, "key 'rl.rewards.0.pattern'"),
             ({}, "key 'rl.reference': a KL penalty (rl.kl_coef > 0) needs a reference model")]  # no --init here
    for over, want in cases:
        conf = _config(setup, "bad", **over)
        r = run_killable([str(BIN / "train"), "launch", str(conf), "--nproc", "1", "--dry-run"], setup["log"],
                         env={"PYTHONPATH": str(HERE)})
        out = setup["log"].read_text()
        assert r == 2 and want in out, (over, out[-2000:])
    # prompts without answers and a reward that needs them
    tmp = setup["tmp"]
    (tmp / "noans.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": f"Say {i}"}) + "\n" for i in range(20)))
    build = yaml.safe_load((tmp / "build.yaml").read_text())
    build["output"], build["sources"][0]["paths"] = str(tmp / "noans"), [str(tmp / "noans.jsonl")]
    (tmp / "b2.yaml").write_text(yaml.safe_dump(build))
    assert run_killable([str(BIN / "datapipe"), "build", "--quiet", str(tmp / "b2.yaml")], setup["log"]) == 0
    conf = _config(setup, "bad", **{"data.dataset": str(tmp / "noans"), "rl.rewards": [{"name": "math"}],
                                    "rl.kl_coef": 0.0})
    r = run_killable([str(BIN / "train"), "launch", str(conf), "--nproc", "1", "--dry-run"], setup["log"],
                     env={"PYTHONPATH": str(HERE)})
    out = setup["log"].read_text()
    assert r == 2 and "key 'rl.rewards.0.name': reward 'math' needs an answer" in out, out[-2000:]
