"""TrainConfig validation (errors name the key), LR schedules, spike detection, MFU, estimate, launch commands."""
import sys

import pytest

from storage.config import ConfigError, from_dict
from train.config import OptimConfig, SpikeConfig, TrainConfig
from train.monitor.metrics import Alerts, flops_per_token, mfu
from train.model.gpt import ModelConfig
from train.optim import SpikeDetector, lr_at


def cfg(**kw) -> TrainConfig:
    return from_dict(TrainConfig, kw)


@pytest.mark.parametrize("data,key", [
    ({"stepz": 3}, "stepz"),                                            # unknown key
    ({"parallel": {"tp": "two"}}, "parallel.tp"),                       # wrong type
    ({"optim": {"schedule": "linear"}}, "optim.schedule"),              # not one of the choices
    ({"parallel": {"tp": 8}}, "parallel.tp"),                           # TP > heads (tiny has 4)
    ({"parallel": {"tp": 4}}, "parallel.tp"),                           # TP does not divide kv heads (2)
    ({"parallel": {"pp": 3}}, "parallel.pp"),                           # PP does not divide layers (4)
    ({"parallel": {"global_batch_size": 6, "micro_batch_size": 4}}, "parallel.global_batch_size"),
    ({"data": {"seq_len": 4096}}, "data.seq_len"),                      # > max_position_embeddings
    ({"data": {"seq_len": 0}}, "data.seq_len"),
    ({"optim": {"lr": 1.0e-4, "min_lr": 1.0e-3}}, "optim.min_lr"),
    ({"steps": 0}, "steps"),
    ({"parallel": {"batch_rampup": {"start": 0, "increment": 2, "over_tokens": 512}}}, "parallel.batch_rampup.start"),
    ({"parallel": {"batch_rampup": {"start": 8, "increment": 2, "over_tokens": 512}}}, "parallel.batch_rampup.start"),
    ({"parallel": {"batch_rampup": {"start": 2, "increment": 4, "over_tokens": 512}}}, "parallel.batch_rampup.increment"),
    ({"parallel": {"batch_rampup": {"start": 2, "increment": 2}}}, "parallel.batch_rampup.over_tokens"),  # missing
    ({"parallel": {"batch_rampup": {"start": 2, "increment": 2, "over_tokens": 100}}}, "parallel.batch_rampup.over_tokens"),
    ({"objective": "sft", "parallel": {"batch_rampup": {"start": 2, "increment": 2, "over_tokens": 512}}},
     "parallel.batch_rampup"),
])
def test_bad_config_names_key(data, key):
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        cfg(**data)


def test_world_checks_name_key():
    c = cfg(parallel={"tp": 2, "global_batch_size": 8, "micro_batch_size": 2})
    with pytest.raises(ConfigError, match="key 'parallel.tp'.*world size 3"):
        c.check_world(3)
    with pytest.raises(ConfigError, match="key 'parallel.global_batch_size'"):
        c.check_world(16)  # dp 8 × mbs 2 = 16 > 8
    c.check_world(4)
    assert c.parallel.dp(4) == 2 and c.parallel.num_microbatches(4) == 2
    ramp = cfg(parallel={"global_batch_size": 8, "micro_batch_size": 2,
                         "batch_rampup": {"start": 2, "increment": 2, "over_tokens": 512}})
    ramp.check_world(1)
    with pytest.raises(ConfigError, match="key 'parallel.batch_rampup.start'.*micro_batch_size × dp = 2 × 2"):
        ramp.check_world(2)  # every step's batch must be whole micro-batches on each DP rank
    ramp.parallel.batch_rampup.start = 4
    with pytest.raises(ConfigError, match="key 'parallel.batch_rampup.increment'"):
        ramp.check_world(2)


def test_batch_rampup_sizes_and_lr_schedule():
    """megatron's calculator: 2 → 8 by 2 over 12 sequences (3 ramp steps of 4 sequences each); the LR runs
    on sequences in units of full batches, and is the step schedule exactly without a ramp."""
    from train.optim import LRScheduler
    from train.rampup import BatchSizes

    c = cfg(data={"seq_len": 32}, optim={"lr": 1.0, "min_lr": 0.1, "warmup_steps": 2},
            parallel={"global_batch_size": 8, "micro_batch_size": 1,
                      "batch_rampup": {"start": 2, "increment": 2, "over_tokens": 12 * 32 + 31}})
    sizes = BatchSizes(c.parallel, 32, dp=2)
    consumed, got = 0, []
    for _ in range(7):
        got.append(sizes.at(consumed))
        consumed += got[-1]
    # consumed 0, 2 → 2; 4 → 4 (4 / 4 = 1 ramp step); 8 → 6; 14 > 12 → 8 from then on
    assert got == [2, 2, 4, 6, 8, 8, 8] and sizes.total(7) == consumed == 38 and sizes.total(2) == 4
    assert BatchSizes(cfg().parallel, 256, dp=1).at(10**6) == 8

    class Opt:
        param_groups = [{"wd_mult": 1.0}]

    ramp, plain = LRScheduler(Opt(), c.optim, 7, sizes), LRScheduler(Opt(), c.optim, 7, BatchSizes(cfg().parallel, 256, 1))
    lrs, full = [], []
    for b in got:
        lrs.append(ramp.apply(b))
        ramp.step(b)
        full.append(plain.apply(8))
        plain.step(8)
    # position (sequences after the step) / 8 - 1 over 38 / 8 full batches: a warmup of 2 × 8 sequences,
    # capped at lr where a step ends past it, then the cosine
    pos = [(a + b) / 8 - 1 for a, b in zip([0, 2, 4, 8, 14, 22, 30], got)]
    assert lrs == [lr_at(p, c.optim, 38 / 8) for p in pos]
    assert lrs[:4] == pytest.approx([0.125, 0.25, 0.5, 0.875]) and lrs[4] == 1.0 > lrs[5] > lrs[6]
    assert full == [lr_at(s, c.optim, 7) for s in range(7)]
    assert ramp.state_dict() == {"step_count": 7, "sequences": 38}


def test_missing_dataset_fails_before_launch(tmp_path):
    with pytest.raises(ConfigError, match="key 'data.dataset': required"):
        cfg().check_data()
    with pytest.raises(ConfigError, match="key 'data.dataset': cannot read a manifest"):
        cfg(data={"dataset": str(tmp_path / "nope")}).check_data()
    cfg(debug={"synthetic_data": True}).check_data()


def test_vocab_from_dataset(random_dataset):
    root, man = random_dataset
    c = cfg(data={"dataset": root}).resolved_for_data()
    assert c.model.resolved().vocab_size == man.tokenizer.vocab_size
    with pytest.raises(ConfigError, match="key 'model.vocab_size'"):
        cfg(data={"dataset": root}, model={"vocab_size": 1000}).check_data()


def test_cosine_schedule():
    o = OptimConfig(lr=1.0, min_lr=0.1, schedule="cosine", warmup_steps=10)
    assert lr_at(0, o, 110) == pytest.approx(0.1)   # warmup is linear from lr/warmup
    assert lr_at(9, o, 110) == pytest.approx(1.0)
    assert lr_at(10, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.55)  # halfway: (lr + min_lr) / 2
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    lrs = [lr_at(s, o, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_wsd_schedule():
    o = OptimConfig(lr=1.0, min_lr=0.0, schedule="wsd", warmup_steps=5, decay_fraction=0.2)
    total = 100
    assert [lr_at(s, o, total) for s in (0, 4)] == pytest.approx([0.2, 1.0])
    assert all(lr_at(s, o, total) == 1.0 for s in range(5, 80))   # stable
    assert lr_at(80, o, total) == pytest.approx(0.95)               # linear decay over the last 20 steps
    assert lr_at(99, o, total) == pytest.approx(0.0)
    assert lr_at(5, OptimConfig(lr=2.0, schedule="constant", warmup_steps=0), total) == 2.0


def test_no_weight_decay_on_norms_and_biases(tmp_path):
    """One AdamW step on zero gradients moves a parameter only through weight decay: the matrices shrink by
    lr × weight_decay, the RMSNorm weights (1-D, megatron's wd_mult 0 group) stay as they are."""
    import torch

    from testutil import megatron_one_rank
    from train.model.gpt import build_model
    from train.optim import LRScheduler, build_optimizer, clip_and_step, grad_norm
    from train.model.parallel import wrap_ddp

    c = cfg(model={"preset": "tiny", "hidden_size": 64, "num_layers": 1, "ffn_hidden_size": 96},
            optim={"lr": 0.5, "weight_decay": 0.1, "warmup_steps": 0, "schedule": "constant"})
    with megatron_one_rank(tmp_path):
        model = wrap_ddp(c, build_model(c.model, seed=1))
        opt = build_optimizer(c, model)
        before = {n: p.detach().clone() for n, p in model[0].named_parameters()}
        model[0].zero_grad_buffer()
        LRScheduler(opt, c.optim, c.steps).apply(c.parallel.global_batch_size)
        clip_and_step(opt, grad_norm(opt), c.optim.clip_grad)
        after = dict(model[0].named_parameters())
    norms = [n for n in before if before[n].dim() == 1]
    assert norms and all("norm" in n for n in norms)
    for n, w in before.items():
        want = w if w.dim() == 1 else w * (1 - 0.5 * 0.1)
        assert torch.allclose(after[n].detach(), want, rtol=0, atol=1e-7), n


def test_spike_detector():
    d = SpikeDetector(SpikeConfig(window=50, zscore=4.0, min_history=10))
    for i in range(9):
        d.accept(3.0 + 0.01 * (i % 3))
    assert not d.is_spike(100.0), "no decisions before min_history"
    d.accept(3.01)
    assert d.is_spike(3.5) and not d.is_spike(3.02) and not d.is_spike(1.0)
    sd = d.state_dict()
    d2 = SpikeDetector(SpikeConfig(window=50, zscore=4.0, min_history=10))
    d2.load_state_dict(sd)
    assert d2.zscore(3.5) == d.zscore(3.5)


def test_flops_per_token_formula():
    m = ModelConfig(preset="tiny")  # h 128, L 4, heads 4 (kv 2, head 32), ffn 352, vocab 1024
    h, L, f, V, s = 128, 4, 352, 1024, 256
    per_layer = h * h + 2 * h * 64 + h * h + 3 * h * f
    expect = 6 * (L * per_layer + V * h) + 12 * L * s * h
    assert flops_per_token(m, s) == expect
    # the attention term grows with the sequence length
    assert flops_per_token(m, 2 * s) - flops_per_token(m, s) == 12 * L * s * h
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert mfu(1000.0, 1e9, None) is None


def _mfu_warnings(a: Alerts, mfus) -> list[int]:
    """Indices of the records (MFU values, None: unknown) on which an MFU warning fired."""
    return [i for i, m in enumerate(mfus) if any("MFU" in w for w in a.check({"mfu": m, "mem_fraction": 0.1})[0])]


def test_mfu_alert_fires_when_sustained_once_per_episode():
    low, ok = 0.2, 0.35
    a = Alerts(mfu_warn_below=0.3, memory_stop_above=0.9, mfu_window=3)
    # one noisy record, two in a row: nothing; the third in a row fires; the episode stays quiet;
    # a record at or above the threshold re-arms it; records without MFU neither count nor reset
    mfus = [low, ok, low, low, ok, low, low, low, low, low, ok, low, None, low, low, low]
    assert _mfu_warnings(a, mfus) == [7, 14]
    w, _ = Alerts(0.3, 0.9, mfu_window=2).check({"mfu": 0.2, "mem_fraction": 0.1})
    assert w == []
    a = Alerts(0.3, 0.9)  # default window: 5 records
    assert _mfu_warnings(a, [low] * 12) == [4]
    w = Alerts(0.3, 0.9, mfu_window=1).check({"mfu": 0.2, "mem_fraction": 0.1})[0]
    assert len(w) == 1 and "below 30%" in w[0] and "last 20.0%" in w[0]
    assert _mfu_warnings(Alerts(0.0, 0.0, mfu_window=1), [0.01, 0.01]) == []  # 0: off


def test_comm_and_memory_alerts():
    a = Alerts(mfu_warn_below=0.3, memory_stop_above=0.9, comm_share_warn_above=0.15)
    shares = [0.5, 0.1, 0.2, 0.3, 0.15, 0.25]
    fired = [a.check({"comm_share": c, "comm_share_dp": c, "comm_share_max": c + 0.01, "mem_fraction": 0.5})[0]
             for c in shares]
    # the first record (warm-up) is not judged; once per episode, re-armed at <= 15 %
    assert [bool(w) for w in fired] == [False, False, True, False, False, True]
    assert "communication is 20.0% of step time" in fired[2][0] and "dp 20.0%" in fired[2][0]
    assert "worst rank 21.0%" in fired[2][0]
    w, stop = a.check({"mfu": None, "mem_fraction": 0.95})
    assert w == [] and "stopping" in stop
    assert Alerts(0.0, 0.0, comm_share_warn_above=0.0).check(
        {"mfu": 0.01, "comm_share": 0.9, "mem_fraction": 0.99}) == ([], None)
    with pytest.raises(ConfigError, match="key 'alerts.mfu_window'"):
        cfg(alerts={"mfu_window": 0})
    with pytest.raises(ConfigError, match="key 'alerts.comm_share_warn_above'"):
        cfg(alerts={"comm_share_warn_above": 1.5})


def test_fp8_refused_with_reason_before_any_process(tmp_path, monkeypatch):
    import importlib.util
    import types

    import torch
    from click.testing import CliRunner

    from train.cli import main
    from train.model import precision as tc

    c = cfg(precision="fp8")  # loads: `train estimate` of an fp8 run works anywhere
    assert c.bf16_weights() and cfg(precision="bf16").bf16_weights() and not cfg().bf16_weights()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="key 'precision'.*no CUDA GPU.*Transformer Engine is not installed"):
        c.check_world(1)
    cfg().check_world(1)  # fp32 and bf16 need nothing
    conf = tmp_path / "c.yaml"
    conf.write_text(f"run_dir: {tmp_path / 'run'}\nprecision: fp8\ndebug: {{synthetic_data: true}}\n")
    r = CliRunner().invoke(main, ["launch", str(conf), "--nproc", "1"])  # no --dry-run: nothing may start
    assert r.exit_code == 2 and "key 'precision'" in r.output and "no CUDA GPU" in r.output
    assert "torch.distributed.run" not in r.output

    # a GPU too old (A100, 8.0), TE present
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
    te.pytorch.fp8.check_fp8_support = lambda: (True, "")
    for m in (te, te.pytorch, te.pytorch.fp8):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine"
                        else real_find_spec(name, *a))
    assert tc.fp8_unsupported_reasons() == ["GPU 0 (NVIDIA A100-SXM4-80GB) has compute capability 8.0, "
                                            "FP8 needs >= 8.9"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))  # H100/H200
    assert tc.fp8_unsupported_reasons() == []
    c.check_world(1)
    te.pytorch.fp8.check_fp8_support = lambda: (False, "CUDA 12.1+ required")
    assert tc.fp8_unsupported_reasons() == ["Transformer Engine reports no FP8 support: CUDA 12.1+ required"]


def test_fp8_transformer_config_kwargs():
    import dataclasses

    from train.model.precision import fp8_transformer_kwargs
    from train.model.gpt import transformer_config

    assert fp8_transformer_kwargs("bf16") == {} and fp8_transformer_kwargs("fp32") == {}
    tcfg = transformer_config(ModelConfig(preset="tiny"), bf16=True)
    fp8 = dataclasses.replace(tcfg, **fp8_transformer_kwargs("fp8"))  # megatron-core accepts and validates them
    assert fp8.fp8 == "hybrid" and fp8.fp8_recipe == "delayed" and fp8.fp8_amax_history_len == 1024
    assert fp8.bf16 and tcfg.fp8 is None


def test_estimate_1_7b_bf16():
    from train.monitor.estimate import estimate

    c = cfg(model={"preset": "1.7b"}, precision="bf16", data={"seq_len": 4096},
            parallel={"micro_batch_size": 4, "global_batch_size": 64})
    e = estimate(c, world=1)
    # SmolLM2-1.7B as published (its HF config: hidden 2048, 24 layers, 32 heads and 32 KV heads, MLP 8192,
    # vocabulary 49,152, tied embeddings): q, k, v, o and gate, up, down per layer, the embedding once, and
    # two RMSNorm weights per layer plus the final one: the published 1,711,376,384 parameters
    h, L, f, V, s = 2048, 24, 8192, 49152, 4096
    matmul = L * (4 * h * h + 3 * h * f) + V * h
    assert e["params"] == matmul + (2 * L + 1) * h == 1_711_376_384
    # training FLOPs per token: 6 per matmul parameter plus 12·L·s·h for attention (PaLM, appendix B)
    assert e["flops_per_token"] == 6 * matmul + 12 * L * s * h
    # bf16 megatron: 2 + 4 + 12 bytes per parameter for weights, fp32 grads, master + Adam
    assert e["memory_gib"]["optimizer"] == pytest.approx(e["params_per_gpu"] * 12 / 2**30)
    dist = estimate(cfg(model={"preset": "1.7b"}, precision="bf16", data={"seq_len": 4096},
                        parallel={"micro_batch_size": 4, "global_batch_size": 64, "distributed_optimizer": True}),
                    world=8)
    assert dist["memory_gib"]["optimizer"] == pytest.approx(e["memory_gib"]["optimizer"] / 8)
    tp2 = estimate(cfg(model={"preset": "1.7b"}, precision="bf16", parallel={"tp": 2}), world=2)
    assert tp2["params_per_gpu"] < 0.51 * e["params_per_gpu"]
    # tokens/s = MFU x peak / FLOPs per token. The default peak is an H100 SXM5's dense BF16 rate from its
    # datasheet figures: 132 SMs x 4 tensor cores x 512 dense FP16/BF16 FMA (1024 FLOP) per clock x 1.83 GHz;
    # the default MFU is the 45 % that docs/train.md documents (`--mfu 0.45`).
    h100 = 132 * 4 * 1024 * 1.83e9
    fpt = 6 * matmul + 12 * L * s * h
    assert e["mfu"] == 0.45 and e["peak_flops"] == pytest.approx(h100, rel=1e-4)
    assert e["tokens_per_s_per_gpu"] == pytest.approx(0.45 * h100 / fpt, rel=1e-4)
    other = estimate(c, world=1, mfu=0.3, peak=312e12)
    assert other["tokens_per_s_per_gpu"] == pytest.approx(0.3 * 312e12 / fpt)
    # fp8 (sized on any machine, no GPU check): bf16 weights and activations, the bf16 peak
    fp8 = estimate(cfg(model={"preset": "1.7b"}, precision="fp8", data={"seq_len": 4096},
                       parallel={"micro_batch_size": 4, "global_batch_size": 64}), world=1)
    assert fp8["memory_gib"] == e["memory_gib"] and fp8["tokens_per_s_per_gpu"] == e["tokens_per_s_per_gpu"]


def test_torchrun_and_sbatch_commands(tmp_path):
    from train.launch import sbatch_script, torchrun_command

    c = cfg(run_dir=str(tmp_path / "run"), launch={"rdzv_endpoint": "10.0.0.1:1234"},
            parallel={"global_batch_size": 64})
    single = torchrun_command(c, "x.yaml", 2, 1)
    assert "--standalone" in single and "--nproc-per-node=2" in single and single[-3:] == ["-m", "train.run", "x.yaml"]
    multi = torchrun_command(c, "x.yaml", 1, 2, node_rank=1)
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:1234", "--node-rank=1"} <= set(multi)
    c.launch.slurm.nodes, c.launch.slurm.partition = 4, "gpu"
    text = sbatch_script(c, tmp_path / "run" / "config.yaml", tmp_path)
    for needle in ("#SBATCH --nodes=4", "#SBATCH --requeue", "#SBATCH --partition=gpu", "export NCCL_DEBUG=WARN",
                   "--rdzv-backend=c10d", "--nnodes=4 --nproc-per-node=8", sys.executable, "srun "):
        assert needle in text, needle


def test_cli_estimate_preset_and_errors():
    from click.testing import CliRunner

    from train.cli import main

    r = CliRunner().invoke(main, ["estimate", "--preset", "360m", "--gpus", "1"])
    assert r.exit_code == 0, r.output
    assert "361.8 M parameters" in r.output and "GFLOP" in r.output and "GiB" in r.output
    r = CliRunner().invoke(main, ["estimate", "--preset", "3b", "--set", "parallel.tp=32"])
    assert r.exit_code != 0 and "parallel.tp" in r.output


def test_cli_launch_fails_before_any_process(tmp_path):
    from click.testing import CliRunner

    from train.cli import main

    conf = tmp_path / "c.yaml"
    conf.write_text(f"run_dir: {tmp_path / 'run'}\nparallel: {{tp: 2}}\n")
    r = CliRunner().invoke(main, ["launch", str(conf), "--nproc", "2", "--dry-run"])
    assert r.exit_code == 2 and "key 'data.dataset'" in r.output
    r = CliRunner().invoke(main, ["launch", str(conf), "--nproc", "3", "--set", "debug.synthetic_data=true"])
    assert r.exit_code == 2 and "world size 3" in r.output
    r = CliRunner().invoke(main, ["launch", str(conf), "--nproc", "2", "--dry-run",
                                  "--set", "debug.synthetic_data=true"])
    assert r.exit_code == 0 and "torch.distributed.run" in r.output
    assert (tmp_path / "run" / "config.yaml").exists()


def test_data_mix_reweights_the_stage(tmp_path):
    """data.mix replaces the manifest's schedule for one run (a mid-training stage): with all the weight on
    one source every token comes from it; keys are checked against the manifest before any process starts."""
    import types

    import numpy as np
    import torch

    from storage.dataset import SourceWriter
    from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest
    from train.data import make_loader

    root, rng, infos = str(tmp_path / "ds"), np.random.default_rng(0), {}
    for name, lo in (("web", 1), ("code", 30_000)):  # disjoint token ranges tell the sources apart
        w = SourceWriter(root, name, "uint16", block_tokens=512, shard_blocks=4)
        for i in range(60):
            w.add_document(f"{name}-{i}", np.append(rng.integers(lo, lo + 20_000, int(rng.integers(20, 300))), 0))
        infos[name] = w.close()
    write_manifest(root, Manifest(TokenizerInfo("tokenizer.json", "0" * 64, 50_000, 0, "uint16"), infos,
                                  [Phase("stable", {"web": 0.9, "code": 0.1}, 1)]))
    base = {"data": {"dataset": root, "seq_len": 64, "prefetch_threads": 1, "decode_processes": 0},
            "parallel": {"global_batch_size": 8}}
    par = types.SimpleNamespace(dp_rank=0, dp=1, device=torch.device("cpu"))

    def tokens(**data) -> np.ndarray:
        c = from_dict(TrainConfig, {**base, "data": {**base["data"], **data}})
        c.check_data()
        loader = make_loader(c, par)
        try:
            return np.concatenate([next(loader).numpy().ravel() for _ in range(6)])
        finally:
            loader.close()

    staged, natural = tokens(mix={"code": 1.0}), tokens()
    assert ((staged == 0) | (staged >= 30_000)).all()
    assert ((natural > 0) & (natural < 30_000)).mean() > 0.5  # the manifest's phase: mostly web
    with pytest.raises(ConfigError, match=r"key 'data.mix.docs': no such source .*sources: code, web"):
        tokens(mix={"docs": 1.0})
    with pytest.raises(ConfigError, match=r"key 'data.mix.code': weight must be > 0"):
        cfg(data={"mix": {"code": 0}})
    with pytest.raises(ConfigError, match=r"key 'data.mix': reweights pretraining sources"):
        cfg(objective="sft", data={"dataset": root, "mix": {"code": 1.0}})
