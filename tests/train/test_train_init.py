"""`train launch --init CHECKPOINT` through real torchrun/gloo runs: a run started from a TP2 checkpoint
runs at TP1 (resharded on load) from step 0 with a fresh optimizer and schedule and exactly the
checkpoint's weights; a relaunch of that run resumes from its own checkpoint instead of re-initialising.
A new stage (`--keep-optimizer`, longer seq_len, raised RoPE theta and max_position_embeddings) continues
from the checkpoint's weights and optimizer state (resharded TP2 -> TP1) under its own hyper-parameters,
trains on its own order from sequence 0 with the new seq_len and theta in effect (a loss recomputed in
process), and records both stages."""
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


def _launch(args, log, env=None):
    rc = run_killable([TRAIN, "launch", *args, "--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], log,
                      timeout=300, env=env)
    assert rc == 0, open(log).read()[-5000:]


def _events(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" in r]


def _optimizer_tensors(ckpt) -> dict:
    """Whole optimizer state tensors (exp_avg, exp_avg_sq, ...) of a raw full checkpoint, by global key."""
    from train.checkpoint.incremental import RAW_DIR, PieceSet

    pieces, out = PieceSet(str(ckpt), RAW_DIR), {}
    for key in pieces.keys():
        if key.startswith("optimizer"):
            e = pieces.entries(key)[0]
            out[key] = torch.empty(e["global_shape"], dtype=getattr(torch, e["dtype"]))
            pieces.apply(key, (0,) * out[key].dim(), out[key])
    return out


def _common_optimizer(ckpt) -> dict:
    """The optimizer's non-tensor state of a checkpoint: param groups and AdamW's common step."""
    return torch.load(ckpt / "common.pt", weights_only=False)["optimizer"]


def _losses_on_second_batch(tmp_path, run_dir, ckpt, thetas) -> list[float]:
    """In process, for each RoPE theta: the loss of checkpoint `ckpt`'s weights on the second global batch
    of a fresh synthetic order of run_dir's resolved config (its seq_len, data seed and global batch)."""
    import dataclasses

    from storage import config as cfgmod
    from testutil import megatron_one_rank
    from train.checkpoint.init_from import load_weights
    from train.config import TrainConfig
    from train.data import SyntheticLoader
    from train.model.gpt import build_model

    cfg = cfgmod.load(TrainConfig, str(run_dir / "config.yaml"))
    loader = SyntheticLoader(cfg.model.vocab_size, cfg.data.seq_len, cfg.parallel.global_batch_size, cfg.data.seed)
    next(loader)
    batch = next(loader)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    (tmp_path / "pg").mkdir()
    out = []
    with megatron_one_rank(tmp_path / "pg"), torch.no_grad():
        for theta in thetas:
            chunks = build_model(dataclasses.replace(cfg.model, rope_theta=theta))
            load_weights(chunks, None, str(ckpt))
            out.append(float(chunks[0](tokens, positions, None, labels=labels).float().sum() / labels.numel()))
    return out


def _stages(ckpt) -> list[dict]:
    return json.loads((ckpt / "manifest.json").read_text())["meta"]["stages"]


def _check_resolve(tmp_path, src_ckpt):
    """In process, before torchrun: stage keys may change, shapes may not; --keep-optimizer checks."""
    from storage import config as cfgmod
    from storage.config import ConfigError
    from train.checkpoint.init_from import resolve
    from train.config import TrainConfig

    def cfg(**over):
        c = cfgmod.load(TrainConfig, _config(tmp_path, tmp_path / "probe", {"preset": "tiny", "hidden_size": 128,
                                                                             "rope_theta": 1e6}, **over))
        c.init = str(src_ckpt)
        return c

    with pytest.raises(ConfigError) as e:
        resolve(cfg())
    assert "model.hidden_size" in str(e.value) and "rope_theta" not in str(e.value)
    with pytest.raises(ConfigError, match="precision"):
        c = cfg(precision="bf16", init_keep_optimizer=True)
        c.model.hidden_size = None
        resolve(c)
    with pytest.raises(ConfigError, match="distributed_optimizer"):
        c = cfg(init_keep_optimizer=True, parallel={"distributed_optimizer": True, "micro_batch_size": 2,
                                                    "global_batch_size": 2})
        c.model.hidden_size = None
        resolve(c)
    with pytest.raises(ConfigError, match="init_keep_optimizer"):
        c = cfg(init_keep_optimizer=True)
        c.init = None
        resolve(c)


def test_init_from_tp2_checkpoint_at_tp1_then_resume_wins(tmp_path):
    from train.checkpoint.export_hf import load_model_tensors

    src = tmp_path / "src"
    # rank 1 lags after each save's gather, so rank 0 commits (renames the folder) first: the save must not
    # read the temporary folder after that point (a race seen under load in CI)
    _launch([_config(tmp_path, src, MODEL, parallel={"tp": 2, "micro_batch_size": 2, "global_batch_size": 2}),
             "--nproc", "2"], tmp_path / "src.log", env={"SMOLTRAIN_CKPT_LAG_S": "1.5"})
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
    # without --keep-optimizer the optimizer starts fresh: AdamW makes its moments at its first update, which
    # was skipped, so step 1's checkpoint holds none of the source's (which has them), and step 2's, after
    # one update, holds every one of them: its own (not the source's values)
    src_opt = _optimizer_tensors(src_ckpt)
    assert src_opt and any("exp_avg_sq" in k for k in src_opt) and all(t.any() for t in src_opt.values())
    assert _optimizer_tensors(run / "checkpoints" / "step_00000001") == {}
    second = _optimizer_tensors(run / "checkpoints" / "step_00000002")
    assert sorted(second) == sorted(src_opt), sorted(second)
    assert all(second[k].any() and not torch.equal(second[k], src_opt[k]) for k in second)
    assert "common_step" not in _common_optimizer(run / "checkpoints" / "step_00000001")["state"]
    assert [(s["stage"], s["init"], s["kept_optimizer"]) for s in _stages(run / "checkpoints" / "step_00000001")] \
        == [(0, None, False), (1, str(src_ckpt), False)]

    # relaunch: the run has checkpoints, so it resumes at step 2 and does not load --init again
    _launch([cfg, "--nproc", "1", "--init", str(src), "--set", "stop_at=3"], tmp_path / "sft2.log")
    kinds = [(e["event"], e["step"]) for e in _events(run)]
    assert ("resume", 2) in kinds and [k for k, _ in kinds].count("init") == 1
    assert [r["step"] for r in metric_records(run)] == [1, 2, 3]
    diverged, _ = load_model_tensors(str(run / "checkpoints" / "step_00000003"))
    assert any(not torch.equal(diverged[k], want[k]) for k in want)  # it trained on from its own state

    # A new stage: seq_len 32 -> 64, RoPE theta 10k -> 40k, max_position_embeddings 1024 -> 2048, AdamW
    # hyper-parameters of its own, keeping the optimizer state (saved at TP2, loaded at TP1). Step 0 is
    # skipped again, so step 1's checkpoint holds what the stage started from.
    _check_resolve(tmp_path, src_ckpt)
    stage = tmp_path / "stage"
    model = {"preset": "tiny", "rope_theta": 40000.0, "max_position_embeddings": 2048}
    cfg = _config(tmp_path, stage, model, data={"seq_len": 64, "seed": 7},
                  optim={"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1, "weight_decay": 0.05, "beta2": 0.99},
                  debug={"synthetic_data": True, "inject_nan_step": 0})
    _launch([cfg, "--nproc", "1", "--init", str(src), "--keep-optimizer"], tmp_path / "stage.log")
    resolved = yaml.safe_load((stage / "config.yaml").read_text())
    assert resolved["init_keep_optimizer"] is True and resolved["model"]["rope_theta"] == 40000.0
    first = stage / "checkpoints" / "step_00000001"
    meta = json.loads((first / "manifest.json").read_text())["meta"]
    assert (meta["model"]["rope_theta"], meta["model"]["max_position_embeddings"]) == (40000.0, 2048)
    # (a) it continues from the checkpoint: exactly its weights, and every optimizer tensor
    got, _ = load_model_tensors(str(first))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    opt_want, opt_got = _optimizer_tensors(src_ckpt), _optimizer_tensors(first)
    assert sorted(opt_got) == sorted(opt_want) and any("exp_avg_sq" in k for k in opt_want)
    for k in opt_want:
        assert opt_want[k].any() and torch.equal(opt_got[k], opt_want[k]), k
    common = _common_optimizer(first)
    assert int(common["state"]["common_step"]) == 2  # AdamW's step carried on (bias correction)...
    assert int(_common_optimizer(stage / "checkpoints" / "step_00000002")["state"]["common_step"]) == 3
    # ...under the stage's hyper-parameters (norms and biases without weight decay), not the checkpoint's
    assert sorted((g["weight_decay"], tuple(g["betas"])) for g in common["param_groups"]) == \
        [(0.0, (0.9, 0.99)), (0.05, (0.9, 0.99))]
    # (b) a fresh loader of the stage's order: step 1 consumed its first global batch (as a fresh run's)
    ts = torch.load(first / "train_state.pt", weights_only=False)
    assert ts["loader"] == {"consumed": 2, "seed": 7, "seq_len": 64} and ts["step"] == 1
    recs = metric_records(stage)
    assert [r["step"] for r in recs] == [1, 2] and recs[0]["consumed_tokens"] == 2 * 64
    assert recs[0]["lr"] == metric_records(src)[0]["lr"]  # a fresh schedule
    # (c) seq_len 64 and theta 40k are in effect on that order: step 2's loss (the checkpoint's weights, step
    # 0's update skipped) is the loss of the second 64-token global batch of the stage's order under theta
    # 40k, recomputed here (bit-identical on this machine; the tolerance covers other thread counts), not
    # the loss under the checkpoint's theta 10k (~1.5e-5 relative away with this tiny model)
    at_40k, at_10k = _losses_on_second_batch(tmp_path, stage, first, thetas=(40000.0, 10000.0))
    assert recs[1]["loss"] == pytest.approx(at_40k, rel=2e-6)
    assert recs[1]["loss"] != pytest.approx(at_10k, rel=2e-6)
    # (d) the history lists both stages
    hist = _stages(stage / "checkpoints" / "step_00000002")
    assert [(h["stage"], h["init"], h["init_step"], h["seq_len"], h["rope_theta"], h["kept_optimizer"])
            for h in hist] == [(0, None, None, 32, 10000.0, False), (1, str(src_ckpt), 2, 64, 40000.0, True)]
    assert hist[1]["dataset"] == "synthetic" and hist[1]["max_position_embeddings"] == 2048
