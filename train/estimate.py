"""`train estimate`: parameters, FLOPs per token, memory per GPU and expected tokens/s, before launching.

Memory per GPU (the busiest pipeline stage, the first: its layers plus the embedding):
- weights + grads + optimizer: bytes per parameter as megatron keeps them — bf16: 2 (bf16 weights)
  + 4 (fp32 grad buffer) + 12 (fp32 master, Adam m, v); fp32: 4 + 4 + 8. The distributed optimizer
  divides the optimizer part (and the master copy) by DP.
- activations: Korthikanti et al. 2022 (eq. 2, no sequence parallel) per layer and micro-batch,
  s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes in 16-bit; the attention-score term is dropped with a fused
  (flash) attention kernel (Transformer Engine); fp32 doubles it. 1F1B keeps min(PP, micro-batches)
  micro-batches in flight on the first stage.
- logits: s·b·V/t in fp32, twice (logits and their gradient).
It is an estimate: allocator fragmentation, communication buffers and workspace come on top.
"""
from __future__ import annotations

from train.config import TrainConfig
from train.metrics import PEAK_BF16, flops_per_token
from train.models import num_parameters


def estimate(cfg: TrainConfig, world: int, flash_attention: bool = True, mfu: float = 0.45,
             peak: float | None = None) -> dict:
    cfg.check_world(world)
    m, p = cfg.model.resolved(), cfg.parallel
    t, pp, dp = p.tp, p.pp, p.dp(world)
    n = num_parameters(cfg.model)
    params_gpu = (m.num_layers // pp) * n["per_layer"] / t + cfg.model.padded_vocab_size(t) * m.hidden_size / t
    bf16 = cfg.precision == "bf16"
    w_b, g_b, o_b = (2, 4, 12) if bf16 else (4, 4, 8)
    if p.distributed_optimizer:
        o_b = o_b / dp
    s, b, h, a = cfg.data.seq_len, p.micro_batch_size, m.hidden_size, m.num_heads
    act_layer = s * b * h * (10 + 24 / t + (0 if flash_attention else 5 * a * s / (h * t)))
    act_layer *= 1 if bf16 else 2
    nmb = p.num_microbatches(world)
    activations = (m.num_layers // pp) * act_layer * min(pp, nmb)
    logits = 2 * 4 * s * b * cfg.model.padded_vocab_size(t) / t
    mem = {"weights": params_gpu * w_b, "grads": params_gpu * g_b, "optimizer": params_gpu * o_b,
           "activations": activations, "logits": logits}
    total = sum(mem.values())
    fpt = flops_per_token(cfg.model, s)
    peak = peak or cfg.monitor.peak_flops or PEAK_BF16["H100"]
    tps_gpu = mfu * peak / fpt
    return {"params": n["total"], "params_per_gpu": params_gpu, "flops_per_token": fpt,
            "memory_gib": {k: v / 2**30 for k, v in mem.items()}, "memory_total_gib": total / 2**30,
            "tp": t, "pp": pp, "dp": dp, "num_microbatches": nmb, "mfu": mfu, "peak_flops": peak,
            "tokens_per_s_per_gpu": tps_gpu, "tokens_per_s": tps_gpu * world,
            "step_time_s": p.global_batch_size * s / (tps_gpu * world)}


def format_estimate(e: dict, cfg: TrainConfig) -> str:
    mem = e["memory_gib"]
    lines = [
        f"model        {cfg.model.preset}: {e['params'] / 1e6:,.1f} M parameters "
        f"({e['params_per_gpu'] / 1e6:,.1f} M per GPU on the first stage)",
        f"parallel     TP {e['tp']} × PP {e['pp']} × DP {e['dp']} = {e['tp'] * e['pp'] * e['dp']} GPUs; "
        f"{e['num_microbatches']} micro-batches of {cfg.parallel.micro_batch_size} × {cfg.data.seq_len} tokens",
        f"FLOPs/token  {e['flops_per_token'] / 1e9:,.2f} GFLOP (training, incl. attention)",
        f"memory/GPU   {e['memory_total_gib']:,.2f} GiB = weights {mem['weights']:.2f} + grads {mem['grads']:.2f}"
        f" + optimizer {mem['optimizer']:.2f} + activations {mem['activations']:.2f} + logits {mem['logits']:.2f}"
        f" ({cfg.precision}{', distributed optimizer' if cfg.parallel.distributed_optimizer else ''})",
        f"throughput   {e['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {e['tokens_per_s']:,.0f} total, "
        f"{e['step_time_s']:.2f} s/step at MFU {100 * e['mfu']:.0f}% of {e['peak_flops'] / 1e12:,.0f} TFLOP/s",
    ]
    return "\n".join(lines)
