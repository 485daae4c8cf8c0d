"""train.model.gpt: preset shapes, validation, and building the tiny GPTModel in one gloo process; activation
recompute (same loss and gradients, bit for bit, at TP1 in process and at TP2 / PP2 under torchrun: this file
is also that torchrun worker), NoPE layers, and recompute in `train estimate`."""
import json
import os
import subprocess
import sys

import pytest
import torch

from storage.config import ConfigError, from_dict
from train.model.gpt import PRESETS, ModelConfig, num_parameters

# Published parameter counts (HF model cards / config.json shapes), tied embeddings.
PUBLISHED = {"135m": 134_515_008, "360m": 361_821_120, "1.7b": 1_711_376_384, "3b": 3_075_098_624}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts(preset):
    assert num_parameters(ModelConfig(preset=preset))["total"] == PUBLISHED[preset]


def test_smollm_shapes():
    assert PRESETS["1.7b"]["num_kv_heads"] == PRESETS["1.7b"]["num_heads"] == 32
    s = ModelConfig(preset="3b").resolved()
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.ffn_hidden_size, s.vocab_size) == \
        (2048, 36, 16, 4, 11008, 128256)


def test_overrides_and_padding():
    m = from_dict(ModelConfig, {"preset": "135m", "vocab_size": 50000, "rope_theta": 1e6})
    r = m.resolved()
    assert (r.vocab_size, r.rope_theta, r.hidden_size) == (50000, 1e6, 576)
    assert m.padded_vocab_size(1) == 50048 and m.padded_vocab_size(2) % 256 == 0


@pytest.mark.parametrize("data,key", [
    ({"preset": "7b"}, "model.preset"),
    ({"num_heads": 5}, "model.num_heads"),
    ({"num_kv_heads": 3}, "model.num_kv_heads"),
    ({"hidden_sise": 64}, "hidden_sise"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"recompute": "some"}, "recompute"),
    ({"recompute_layers": 2}, "model.recompute_layers"),
    ({"recompute": "full", "recompute_layers": 5}, "model.recompute_layers"),
    ({"no_rope_every": 5}, "model.no_rope_every"),
    ({"no_rope_every": -1}, "model.no_rope_every"),
])
def test_bad_model_config_names_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        from_dict(ModelConfig, data)


@pytest.fixture
def one_rank(tmp_path):
    from testutil import megatron_one_rank  # not at the top: this file is also a torchrun worker script

    with megatron_one_rank(tmp_path):
        yield


def test_build_tiny_matches_param_count_and_is_deterministic(one_rank):
    from train.model.gpt import build_model

    cfg = ModelConfig(preset="tiny")
    (m1,) = build_model(cfg, seed=3)
    (m2,) = build_model(cfg, seed=3)
    (m3,) = build_model(cfg, seed=4)
    assert sum(p.numel() for p in m1.parameters()) == num_parameters(cfg)["total"]
    w1, w2, w3 = (dict(m.named_parameters()) for m in (m1, m2, m3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["embedding.word_embeddings.weight"], w3["embedding.word_embeddings.weight"])
    assert torch.all(w1["decoder.final_layernorm.weight"] == 1)
    cfg_m = m1.config
    assert (cfg_m.num_query_groups, cfg_m.gated_linear_unit, cfg_m.add_bias_linear) == (2, True, False)
    tok = torch.randint(0, 1024, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    loss = m1(tok, pos, None, labels=torch.randint(0, 1024, (2, 16)))
    assert loss.shape == (2, 16) and 6.0 < loss.mean().item() < 8.0  # ~ln(1024) at init


def test_tp_slice_keeps_gate_and_up_halves():
    from train.model.gpt import _tp_slice

    full = torch.arange(8).reshape(8, 1)  # gate rows 0-3, up rows 4-7
    assert _tp_slice(full, 0, 2, 0, gated=True).flatten().tolist() == [0, 1, 4, 5]
    assert _tp_slice(full, 0, 2, 1, gated=True).flatten().tolist() == [2, 3, 6, 7]
    assert _tp_slice(full, 0, 2, 1, gated=False).flatten().tolist() == [4, 5, 6, 7]


def test_nope_presets_follow_smollm3():
    # SmolLM3's transformers config: no_rope_layers[i] = int((i + 1) % 4 != 0), 1 = RoPE; megatron's no_rope_freq
    # list is its complement (1 = skip RoPE)
    m = ModelConfig(preset="3b")
    assert m.resolved().no_rope_every == 4
    assert m.no_rope_layers() == [1 - int((i + 1) % 4 != 0) for i in range(36)]
    assert sum(m.no_rope_layers()) == 9
    assert all(ModelConfig(preset=p).no_rope_layers() is None for p in ("tiny", "135m", "360m", "1.7b"))
    assert ModelConfig(preset="3b", no_rope_every=0).no_rope_layers() is None  # 0 switches it off
    assert ModelConfig(preset="tiny", num_layers=6, no_rope_every=4).no_rope_layers() == [0, 0, 0, 1, 0, 0]
    assert num_parameters(m)["total"] == PUBLISHED["3b"]  # NoPE adds no parameters


def test_recompute_layers_per_stage():
    assert ModelConfig(preset="tiny").recompute_layers_per_stage() == 0
    assert ModelConfig(preset="tiny", recompute="selective").recompute_layers_per_stage() == 0
    assert ModelConfig(preset="tiny", recompute="full").recompute_layers_per_stage(2) == 2
    assert ModelConfig(preset="tiny", recompute="full", recompute_layers=3).recompute_layers_per_stage(1) == 3
    assert ModelConfig(preset="tiny", recompute="full", recompute_layers=3).recompute_layers_per_stage(2) == 2


# (recompute, recompute_layers): none, selective (core_attn), full every layer (uniform), full first layer (block)
RECOMPUTE = (("none", None), ("selective", None), ("full", None), ("full", 1))
SEQ, MBS, NMB = 32, 2, 2


def _recompute_runs(tp: int, pp: int) -> dict:
    """{recompute: (losses, grads, calls)} for the tiny model (dropout 0.1) at this TP × PP, two micro-batches
    through megatron's pipeline schedule. `calls`: forwards of the stage's first layer and of its core attention
    (a recomputed region runs twice per micro-batch)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from train.model.gpt import build_model

    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 1024, (MBS, SEQ), generator=gen), torch.randint(0, 1024, (MBS, SEQ), generator=gen))
               for _ in range(NMB)]
    pos = torch.arange(SEQ).expand(MBS, SEQ)
    out = {}
    for rc, layers in RECOMPUTE:
        cfg = ModelConfig(preset="tiny", dropout=0.1, recompute=rc, recompute_layers=layers)
        (m,) = build_model(cfg, tp=tp, pp=pp, seed=3)
        torch.manual_seed(11)  # same dropout masks in every variant
        model_parallel_cuda_manual_seed(11)
        calls = {"layer": 0, "core_attn": 0}
        m.decoder.layers[0].register_forward_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1))
        m.decoder.layers[0].self_attention.core_attention.register_forward_hook(
            lambda *_: calls.__setitem__("core_attn", calls["core_attn"] + 1))

        def fwd(data_iterator, model):
            tokens, labels = next(data_iterator)
            o = model(tokens, pos, None, labels=labels)

            def loss_func(x):
                loss = x.float().mean()
                return loss, {"loss": loss.detach()}
            return o, loss_func

        res = get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter(batches), model=[m],
                                          num_microbatches=NMB, seq_length=SEQ, micro_batch_size=MBS,
                                          forward_only=False)
        out[(rc, layers)] = ([r["loss"] for r in res], {n: p.grad.clone() for n, p in m.named_parameters()},
                             dict(calls))
    return out


def _compare(runs: dict, layers_per_stage: int) -> dict:
    """Per variant: bit-identical to no recompute (losses and every gradient), and recompute really ran."""
    base_loss, base_grads, _ = runs[("none", None)]
    report = {}
    for (rc, layers), (loss, grads, calls) in runs.items():
        again = NMB * 2
        expect = {"none": (NMB, NMB), "selective": (NMB, again), "full": (again, again)}[rc]
        report[f"{rc}/{layers}"] = {
            "loss_equal": len(loss) == len(base_loss) and all(torch.equal(a, b) for a, b in zip(loss, base_loss)),
            "grads_equal": sorted(grads) == sorted(base_grads) and all(torch.equal(grads[n], base_grads[n]) for n in grads),
            "grads_nonzero": all(bool(g.abs().sum() > 0) for g in grads.values()),
            "calls_ok": (calls["layer"], calls["core_attn"]) == expect, "calls": calls,
            "layers_per_stage": layers_per_stage}
    return report


def _check(report: dict, where: str) -> None:
    for variant, r in report.items():
        assert r["loss_equal"] and r["grads_equal"] and r["grads_nonzero"], (where, variant, r)
        assert r["calls_ok"], (where, variant, r)  # the recomputed region did run again in the backward pass


def test_recompute_gives_identical_loss_and_grads_tp1(one_rank):
    from train.model.gpt import transformer_config

    _check(_compare(_recompute_runs(1, 1), 4), "tp1")
    c = transformer_config(ModelConfig(preset="tiny", recompute="selective"))
    assert (c.recompute_granularity, c.recompute_modules, c.recompute_num_layers) == ("selective", ["core_attn"], None)
    c = transformer_config(ModelConfig(preset="tiny", recompute="full"), pp=2)
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "uniform", 1)
    c = transformer_config(ModelConfig(preset="tiny", recompute="full", recompute_layers=1), pp=2)
    assert (c.recompute_method, c.recompute_num_layers) == ("block", 1)
    c = transformer_config(ModelConfig(preset="tiny", recompute="full", recompute_layers=3), pp=2)
    assert (c.recompute_method, c.recompute_num_layers) == ("uniform", 1)  # 3 >= the stage's 2 layers: all
    assert transformer_config(ModelConfig(preset="tiny")).recompute_granularity is None


@pytest.mark.slow
def test_recompute_gives_identical_loss_and_grads_tp2_and_pp2(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "recompute.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        os.path.abspath(__file__), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    reports = json.loads(out.read_text())
    assert sorted(reports) == ["pp2/rank0", "pp2/rank1", "tp2/rank0", "tp2/rank1"]
    for where, report in reports.items():
        assert sorted(report) == sorted(f"{rc}/{n}" for rc, n in RECOMPUTE)
        _check(report, where)


def test_nope_changes_the_logits_and_reaches_megatron(one_rank):
    from train.model.gpt import build_model

    tok = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).expand(2, 16)
    logits = {}
    for every in (0, 2):
        (m,) = build_model(ModelConfig(preset="tiny", init_std=0.1, no_rope_every=every), seed=3)
        m.eval()
        with torch.no_grad():
            logits[every] = m(tok, pos, None)
        assert m.config.no_rope_freq == ([0, 1, 0, 1] if every else None)
    # same weights (NoPE has no parameters), other positions: the switch is live
    assert (logits[0] - logits[2]).abs().max().item() > 1e-2
    # the first layer uses RoPE in both: the first position (rotation by 0) cannot tell them apart
    assert (logits[0][:, 0] - logits[2][:, 0]).abs().max().item() < 1e-5


def test_estimate_recompute_lowers_activation_memory():
    from click.testing import CliRunner

    from train.cli import main
    from train.config import TrainConfig
    from train.monitor.estimate import estimate

    def est(flash=True, **model):
        c = from_dict(TrainConfig, {"model": {"preset": "1.7b", **model}, "precision": "bf16",
                                    "data": {"seq_len": 4096},
                                    "parallel": {"micro_batch_size": 4, "global_batch_size": 64}})
        return estimate(c, world=1, flash_attention=flash)

    none, full, block = est(), est(recompute="full"), est(recompute="full", recompute_layers=12)
    act = lambda e: e["memory_gib"]["activations"]  # noqa: E731
    s, b, h, L = 4096, 4, 2048, 24
    layer = s * b * h * (10 + 24) * 1  # bf16, TP1, fused attention
    assert act(none) == pytest.approx(L * layer / 2**30)
    # full: each layer keeps its input (2·s·b·h bytes), plus one layer while it is recomputed
    assert act(full) == pytest.approx((L * 2 * s * b * h + layer) / 2**30)
    assert act(full) < act(block) < act(none)
    assert act(block) == pytest.approx((12 * 2 * s * b * h + 12 * layer) / 2**30)
    # selective drops the attention scores: nothing more with fused attention, the 5·a·s/h term without
    assert act(est(recompute="selective")) == act(none)
    assert act(est(flash=False, recompute="selective")) == act(none) < act(est(flash=False))
    # the extra forward costs FLOPs: tokens/s and model FLOP utilisation fall, the hardware figure stays
    assert 0.25 < full["recompute_flops_per_token"] / full["flops_per_token"] < 0.34
    assert full["tokens_per_s"] < none["tokens_per_s"] and full["hfu"] == none["mfu"] == 0.45 > full["mfu"]
    r = CliRunner().invoke(main, ["estimate", "--preset", "1.7b", "--set", "model.recompute=full"])
    assert r.exit_code == 0 and "recompute    full, 24 layers per stage" in r.output, r.output


if __name__ == "__main__":  # torchrun worker of test_recompute_gives_identical_loss_and_grads_tp2_and_pp2
    from train.model import cpu_compat

    cpu_compat.install()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo")
    mine = {}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        mine[f"{name}/rank{dist.get_rank()}"] = _compare(_recompute_runs(tp, pp), 4 // pp)
        ps.destroy_model_parallel()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({k: v for g in gathered for k, v in g.items()}, f)
    dist.destroy_process_group()
