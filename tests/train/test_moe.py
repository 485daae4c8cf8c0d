"""Mixture of experts (train.model.moe, train.monitor.moe): config errors name the key, parameter counts of the
published shapes, the built model on one gloo rank, and EP=2 (stopped and resumed) equal to EP=1 over real
torchrun runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from storage import config as cfgmod
from storage.config import ConfigError
from train.config import TrainConfig
from train.model.gpt import ModelConfig, num_parameters
from train.model.moe import MoEConfig

REPO = Path(__file__).parents[2]
TINY_MOE = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 96, "z_loss_coeff": 0.001}


def _cfg(moe: dict, sets=()) -> TrainConfig:
    return cfgmod.from_dict(TrainConfig, {"model": {"preset": "tiny", "moe": moe}, "debug": {"synthetic_data": True}},
                            overrides=sets)


@pytest.mark.parametrize("moe,sets,world,key", [
    ({"num_experts": 4, "top_k": 5}, (), None, "model.moe.top_k"),
    ({"num_experts": -1}, (), None, "model.moe.num_experts"),
    ({"num_experts": 4, "capacity_factor": 0.0}, (), None, "model.moe.capacity_factor"),
    ({"num_experts": 4, "load_balancing": "none"}, (), None, "model.moe.aux_loss_coeff"),
    ({"num_experts": 4, "token_dispatcher": "flex"}, (), None, "model.moe.token_dispatcher"),
    ({"num_experts": 4}, ("parallel.ep=0",), None, "parallel.ep"),
    ({"num_experts": 6}, ("parallel.ep=4",), 4, "parallel.ep"),      # 4 does not divide 6 experts
    ({"num_experts": 4}, ("parallel.ep=4",), 2, "parallel.ep"),      # 4 does not divide DP 2
    ({}, ("parallel.ep=2",), 2, "parallel.ep"),                      # EP without experts
    ({"num_experts": 4}, ("parallel.tp=2",), 2, "parallel.tp"),      # TP > 1 needs sequence parallel (TE/Apex)
])
def test_errors_name_the_key(moe, sets, world, key):
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        cfg = _cfg(moe, sets)
        cfg.check_layout(world)
    if world is not None and "tp" in key:
        with pytest.raises(ConfigError, match="Transformer Engine or Apex"):
            _cfg(moe, sets).check_layout(world)


def test_valid_layout_passes():
    _cfg({"num_experts": 4}, ("parallel.ep=2",)).check_layout(2)
    _cfg({"num_experts": 4}, ("parallel.ep=2",)).check_layout(4)


def test_megatron_arguments():
    from train.model.moe import transformer_kwargs

    kw = transformer_kwargs(MoEConfig(num_experts=8, top_k=2, shared_expert_ffn_hidden_size=64, pre_softmax=True,
                                      load_balancing="seq_aux_loss", aux_loss_coeff=0.02, capacity_factor=1.5),
                            dense_ffn=352, ep=2)
    assert kw["num_moe_experts"] == 8 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 352
    assert kw["moe_shared_expert_intermediate_size"] == 64 and kw["moe_router_pre_softmax"] is True
    assert kw["moe_router_load_balancing_type"] == "seq_aux_loss" and kw["moe_aux_loss_coeff"] == 0.02
    assert kw["moe_expert_capacity_factor"] == 1.5 and kw["moe_z_loss_coeff"] is None
    assert kw["moe_grouped_gemm"] is False and kw["expert_model_parallel_size"] == 2
    assert transformer_kwargs(MoEConfig(), 352) == {}


# Shapes from the models' config.json (transformers' OlmoeConfig / Qwen3MoeConfig fields); untied embeddings.
# Published: OLMoE-1B-7B 6.9B total / 1.3B active (Muennighoff et al. 2024); Qwen3-30B-A3B 30.5B / 3.3B (Qwen3
# report). Per-head q/k norms (a few thousand parameters) are not modelled.
OLMOE = dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16, vocab_size=50304, tie_embeddings=False,
             moe=MoEConfig(num_experts=64, top_k=8, ffn_hidden_size=1024, pre_softmax=True))
QWEN3 = dict(hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, vocab_size=151936,
             tie_embeddings=False, moe=MoEConfig(num_experts=128, top_k=8, ffn_hidden_size=768))


@pytest.mark.parametrize("shape,total,active", [(OLMOE, 6.9e9, 1.3e9), (QWEN3, 30.5e9, 3.3e9)])
def test_published_moe_parameter_counts(shape, total, active):
    n = num_parameters(ModelConfig(**shape))
    assert abs(n["total"] / total - 1) < 0.005, n["total"]
    # the active figure is published to two digits (1.3B, 3.3B): ours 1.282B and 3.353B (router included)
    assert abs(n["active"] / active - 1) < 0.02, n["active"]
    m = shape["moe"]
    assert n["moe"]["router"] == shape["hidden_size"] * m.num_experts
    assert n["moe"]["experts"] == m.num_experts * 3 * shape["hidden_size"] * m.ffn_hidden_size


def test_estimate_counts_active_params_and_splits_experts_over_ep():
    from train.monitor.estimate import estimate
    from train.monitor.metrics import flops_per_token

    dense = ModelConfig(preset="tiny")
    moe = ModelConfig(preset="tiny", moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=176))
    nd, nm = num_parameters(dense), num_parameters(moe)
    assert nd["active"] == nd["total"] and nm["active"] < nm["total"]
    # 2 experts of half the dense width (+ router) per token: the FLOPs of the dense model plus the router
    router = 4 * 128 * 8
    assert flops_per_token(moe, 64) - flops_per_token(dense, 64) == pytest.approx(6 * router)
    e1 = estimate(_cfg({"num_experts": 8}, ("data.seq_len=64",)), 2)
    e2 = estimate(_cfg({"num_experts": 8}, ("data.seq_len=64", "parallel.ep=2")), 2)
    experts = 4 * 8 * 3 * 128 * 352
    assert e1["params_per_gpu"] - e2["params_per_gpu"] == pytest.approx(experts / 2)
    assert e1["active_params"] < e1["params"]


def test_manifest_model_section_round_trips():
    cfg = ModelConfig(preset="tiny", moe=MoEConfig(num_experts=4, top_k=1))
    back = ModelConfig(**cfgmod.to_plain(cfg.resolved()))
    assert back.moe == cfg.moe and num_parameters(back) == num_parameters(cfg)


def test_built_model_one_rank(tmp_path):
    """SequentialMLP experts, a shared expert, the alltoall dispatcher (CPU stream stubs) and the router
    losses in megatron's tracker; the parameter count equals num_parameters."""
    import torch
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from testutil import megatron_one_rank

    from train.model.gpt import build_model
    from train.monitor.moe import MoEStats

    cfg = ModelConfig(preset="tiny", num_layers=2, moe=MoEConfig(**TINY_MOE, shared_expert_ffn_hidden_size=64))
    with megatron_one_rank(tmp_path):
        (model,) = build_model(cfg)
        assert isinstance(model.decoder.layers[0].mlp.experts, SequentialMLP)
        assert sum(p.numel() for p in model.parameters()) == num_parameters(cfg)["total"]
        stats = MoEStats([model], cfg.moe, 2, torch.device("cpu"))
        tokens = torch.randint(0, 1024, (2, 16))
        pos = torch.arange(16).expand(2, 16)
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        tracker = get_moe_layer_wise_logging_tracker()
        assert {"load_balancing_loss", "z_loss"} <= set(tracker)
        router = model.decoder.layers[0].mlp.router.weight
        assert router.grad is not None and router.grad.abs().sum() > 0
        out = stats.collect()
        assert out["moe_aux_loss"] > 0 and out["moe_z_loss"] > 0
        per = np.array(out["moe_tokens_per_expert"])
        assert per.shape == (2, 4) and (per.sum(axis=1) == 2 * 16 * 2).all()  # every token to top_k experts
        assert out["moe_load_imbalance_max"] >= out["moe_load_imbalance_mean"] >= 1.0
        assert out["moe_dropped_share"] == 0.0
        assert float(tracker["z_loss"]["values"].sum()) == 0.0  # the tracker is cleared for the next window
        # expert 3 of both layers idle for two windows of 5 steps, then busy again
        stats.idle_steps.zero_()
        for window, busy in ((1, 3), (2, 3), (3, 4)):
            stats.counts[:, :busy] = 7
            stats.micro[:], stats.assigned[:] = 1, 7 * busy
            out = stats.collect(steps=5)
            assert out["moe_idle_steps_max"] == (5 * window if busy == 3 else 0)
            assert out["moe_idle_experts"] == (2 if busy == 3 else 0)
        stats.close()


def test_idle_expert_alert_once_per_episode():
    from train.monitor.metrics import Alerts

    a = Alerts(0.0, 0.0, moe_idle_expert_steps=10)

    def warnings(idle):
        return a.check({"mem_fraction": 0.1, "moe_idle_steps_max": idle, "moe_idle_experts": 1})[0]

    assert warnings(5) == []
    w = warnings(10)
    assert len(w) == 1 and "no token for 10 steps" in w[0]
    assert warnings(20) == []   # once per episode
    assert warnings(0) == []
    assert len(warnings(10)) == 1  # re-armed
    assert Alerts(0.0, 0.0, moe_idle_expert_steps=0).check({"mem_fraction": 0.1, "moe_idle_steps_max": 99,
                                                             "moe_idle_experts": 1})[0] == []


# ---------------------------------------------------------------- torchrun runs (DP 2: EP 2 against EP 1)
BASE = {
    "steps": 12, "seed": 7, "model": {"preset": "tiny", "num_layers": 2, "moe": TINY_MOE},
    "data": {"seq_len": 32}, "parallel": {"global_batch_size": 4, "micro_batch_size": 1},
    "optim": {"lr": 3.0e-3, "warmup_steps": 2, "schedule": "constant"},
    "monitor": {"log_every": 1, "tensorboard": False},
    "checkpoint": {"full_every": 0, "incremental_every": 0},
    "debug": {"synthetic_data": True},
}


def _launch(tmp_path: Path, name: str, sets=()):
    conf = tmp_path / f"{name}.yaml"
    conf.write_text(yaml.safe_dump({**BASE, "run_dir": str(tmp_path / name)}))
    cmd = [sys.executable, "-m", "train.cli", "launch", str(conf), "--nproc", "2"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "loss" in x], r.stdout + r.stderr


@pytest.mark.slow
def test_ep2_equals_ep1(tmp_path):
    """DP 2: EP 2 against EP 1, the EP 2 run stopped at step 6 (checkpoint) and resumed."""
    ep1, _ = _launch(tmp_path, "ep1")
    ckpt = ["parallel.ep=2", "checkpoint.full_every=6"]
    _launch(tmp_path, "ep2", [*ckpt, "stop_at=6"])
    ep2, out = _launch(tmp_path, "ep2", ckpt)
    assert "resumed at step 6" in out
    assert len(ep1) == 12 and [r["step"] for r in ep2] == list(range(1, 13))
    a = np.array([[r["loss"], r["grad_norm"]] for r in ep1])
    b = np.array([[r["loss"], r["grad_norm"]] for r in ep2])
    np.testing.assert_allclose(b, a, rtol=2e-5)
    assert a[-1, 0] != a[0, 0]  # the optimizer did update the weights (synthetic tokens: nothing to learn)
    for r1, r2 in zip(ep1, ep2):
        assert r1["moe_tokens_per_expert"] == r2["moe_tokens_per_expert"]
        for k in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance_max"):
            assert r2[k] == pytest.approx(r1[k], rel=2e-5)
        # 4 sequences of 32 tokens per step, each to 2 of 4 experts, in each of the 2 layers
        assert np.array(r1["moe_tokens_per_expert"]).sum(axis=1).tolist() == [4 * 32 * 2] * 2
    # the experts really are split: EP 2's token all-to-alls (comm kind `other`) are absent at EP 1
    assert all(r["comm_share_other"] == 0 for r in ep1) and all(r["comm_share_other"] > 0 for r in ep2)
    assert "moe aux" in out and " imb " in out  # the console line


def test_console_line():
    from train.monitor.metrics import format_record

    rec = {"step": 3, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "step_time_s": 0.1,
           "data_wait_share": 0.0, "rss_gib": 1.0}
    assert "moe" not in format_record(rec)
    line = format_record({**rec, "moe_aux_loss": 1.01, "moe_z_loss": 2.5, "moe_load_imbalance_max": 1.7,
                          "moe_idle_experts": 0})
    assert "| moe aux 1.010 z 2.50 imb 1.70 |" in line


def test_export_and_merge_refuse_moe():
    from train.checkpoint.errors import CheckpointError
    from train.checkpoint.export_hf import model_shape
    from train.checkpoint.merge import MergeError, _model

    m = {"meta": {"model": cfgmod.to_plain(ModelConfig(moe=MoEConfig(num_experts=4)).resolved())}}
    with pytest.raises(CheckpointError, match="mixture-of-experts checkpoint \\(4 experts\\)"):
        model_shape(m)
    with pytest.raises(MergeError, match="merges do not support MoE"):
        _model("ck", m)
    dense = {"meta": {"model": cfgmod.to_plain(ModelConfig().resolved())}}
    assert model_shape(dense)["hidden_size"] == 128 and _model("ck", dense).hidden_size == 128
