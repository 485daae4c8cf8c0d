"""`train estimate`: parameters, FLOPs per token, memory per GPU and expected tokens/s, before launching.

MoE (model.moe): total and active parameters (router, top_k routed experts, shared expert); FLOPs per token
count the active ones; the routed experts' weights, grads and optimizer state are divided by parallel.ep.
Token-dispatch buffers (alltoall) are not sized.

Memory per GPU (the busiest pipeline stage, the first: its layers plus the embedding):
- weights + grads + optimizer: bytes per parameter as megatron keeps them — bf16: 2 (bf16 weights)
  + 4 (fp32 grad buffer) + 12 (fp32 master, Adam m, v); fp32: 4 + 4 + 8. The distributed optimizer
  divides the optimizer part (and the master copy) by DP. fp8 counts as bf16 everywhere: its weights are
  bf16 (Transformer Engine casts to FP8 inside its GEMMs), activations are sized as bf16, and tokens/s use
  the bf16 peak (no FP8 GEMM speed-up is assumed: none has been measured here).
- activations: Korthikanti et al. 2022 (eq. 2, no sequence parallel) per layer and micro-batch,
  s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes in 16-bit; the attention-score term is dropped with a fused
  (flash) attention kernel (Transformer Engine); fp32 doubles it. 1F1B keeps min(PP, micro-batches)
  micro-batches in flight on the first stage.
- activation recompute (model.recompute): `selective` (megatron's core_attn) drops the attention-score
  term 5·a·s/(h·t) (already absent with fused attention, so it saves nothing more there); `full` keeps
  only the layer input (2·s·b·h bytes in 16-bit) of each recomputed layer of the stage (k =
  model.recompute_layers, default all), plus one layer's full activations while it is recomputed in the
  backward pass when every layer is recomputed: k·2sbh + (L_stage − k)·A per micro-batch in flight (+ A).
- logits: s·b·V/t in fp32, twice (logits and their gradient).
Recompute costs FLOPs: one more forward of the recomputed layers (full: 2 FLOPs per layer matmul parameter
+ 4·s·h attention per token and layer; selective: the attention part 4·s·h per layer). `mfu` is the
assumed utilisation of the hardware's FLOPs, so tokens/s fall by model / (model + recompute) FLOPs and
the reported `mfu` (model FLOPs) is that much lower; `hfu` is the assumed figure.
It is an estimate: allocator fragmentation, communication buffers and workspace come on top.
"""
from __future__ import annotations

from train.config import TrainConfig
from train.monitor.metrics import PEAK_BF16, flops_per_token
from train.model.gpt import num_parameters
from train.model.moe import mlp_matmul_params


def estimate(cfg: TrainConfig, world: int, flash_attention: bool = True, mfu: float = 0.45,
             peak: float | None = None) -> dict:
    cfg.check_layout(world)  # not the fp8 hardware check: a GPU run is sized anywhere
    m, p = cfg.model.resolved(), cfg.parallel
    t, pp, dp = p.tp, p.pp, p.dp(world)
    n = num_parameters(cfg.model)
    # MoE: routed experts are split over parallel.ep ranks (TP 1 with MoE)
    per_layer = n["per_layer"] - (n["moe"]["experts"] * (1 - 1 / p.ep) if "moe" in n else 0)
    params_gpu = (m.num_layers // pp) * per_layer / t + cfg.model.padded_vocab_size(t) * m.hidden_size / t
    bf16 = cfg.bf16_weights()
    w_b, g_b, o_b = (2, 4, 12) if bf16 else (4, 4, 8)
    if p.distributed_optimizer:
        o_b = o_b / dp
    s, b, h, a = cfg.data.seq_len, p.micro_batch_size, m.hidden_size, m.num_heads
    scores = not flash_attention and m.recompute != "selective"
    act_layer = s * b * h * (10 + 24 / t + (5 * a * s / (h * t) if scores else 0))
    act_layer *= 1 if bf16 else 2
    layer_input = 2 * s * b * h * (1 if bf16 else 2)  # what a fully recomputed layer keeps
    nmb = p.num_microbatches(world)
    per_stage, rk = m.num_layers // pp, m.recompute_layers_per_stage(pp)
    activations = min(pp, nmb) * (rk * layer_input + (per_stage - rk) * act_layer) + (act_layer if rk == per_stage else 0)
    logits = 2 * 4 * s * b * cfg.model.padded_vocab_size(t) / t
    mem = {"weights": params_gpu * w_b, "grads": params_gpu * g_b, "optimizer": params_gpu * o_b,
           "activations": activations, "logits": logits}
    total = sum(mem.values())
    fpt = flops_per_token(cfg.model, s)
    hq, hkv = m.num_heads * m.kv_channels(), m.num_kv_heads * m.kv_channels()
    layer_fwd = 2 * (h * hq + 2 * h * hkv + hq * h + mlp_matmul_params(m.moe, h, m.ffn_hidden_size)) + 4 * s * hq
    recompute_fpt = rk * pp * layer_fwd if m.recompute == "full" else \
        (m.num_layers * 4 * s * hq if m.recompute == "selective" else 0)
    peak = peak or cfg.monitor.peak_flops or PEAK_BF16["H100"]
    tps_gpu = mfu * peak / (fpt + recompute_fpt)
    return {"params": n["total"], "active_params": n["active"], "params_per_gpu": params_gpu, "ep": p.ep, "flops_per_token": fpt,
            "recompute_flops_per_token": recompute_fpt, "recompute": m.recompute, "recompute_layers_per_stage": rk,
            "memory_gib": {k: v / 2**30 for k, v in mem.items()}, "memory_total_gib": total / 2**30,
            "tp": t, "pp": pp, "dp": dp, "num_microbatches": nmb, "mfu": mfu * fpt / (fpt + recompute_fpt) if recompute_fpt else mfu,
            "hfu": mfu, "peak_flops": peak, "tokens_per_s_per_gpu": tps_gpu, "tokens_per_s": tps_gpu * world,
            "step_time_s": p.global_batch_size * s / (tps_gpu * world)}


def format_estimate(e: dict, cfg: TrainConfig) -> str:
    mem = e["memory_gib"]
    lines = [
        f"model        {cfg.model.preset}: {e['params'] / 1e6:,.1f} M parameters "
        + (f"({e['active_params'] / 1e6:,.1f} M active: {cfg.model.moe.num_experts} experts, top "
           f"{cfg.model.moe.top_k}, EP {e['ep']}) " if cfg.model.moe.enabled else "")
        + f"({e['params_per_gpu'] / 1e6:,.1f} M per GPU on the first stage)",
        f"parallel     TP {e['tp']} × PP {e['pp']} × DP {e['dp']} = {e['tp'] * e['pp'] * e['dp']} GPUs; "
        f"{e['num_microbatches']} micro-batches of {cfg.parallel.micro_batch_size} × {cfg.data.seq_len} tokens",
        f"FLOPs/token  {e['flops_per_token'] / 1e9:,.2f} GFLOP (training, incl. attention)",
        f"memory/GPU   {e['memory_total_gib']:,.2f} GiB = weights {mem['weights']:.2f} + grads {mem['grads']:.2f}"
        f" + optimizer {mem['optimizer']:.2f} + activations {mem['activations']:.2f} + logits {mem['logits']:.2f}"
        f" ({cfg.precision}{' as bf16' if cfg.precision == 'fp8' else ''}"
        f"{', distributed optimizer' if cfg.parallel.distributed_optimizer else ''})",
        f"throughput   {e['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {e['tokens_per_s']:,.0f} total, "
        f"{e['step_time_s']:.2f} s/step at MFU {100 * e['mfu']:.0f}% of {e['peak_flops'] / 1e12:,.0f} TFLOP/s"
        + (" (the bf16 peak: no FP8 speed-up assumed)" if cfg.precision == "fp8" else ""),
    ]
    if e["recompute"] != "none":
        what = (f"full, {e['recompute_layers_per_stage']} layers per stage" if e["recompute"] == "full"
                else "selective (attention scores)")
        lines.append(f"recompute    {what}: +{e['recompute_flops_per_token'] / 1e9:,.2f} GFLOP/token "
                     f"(+{100 * e['recompute_flops_per_token'] / e['flops_per_token']:.0f}%), "
                     f"{100 * e['hfu']:.0f}% hardware FLOP utilisation assumed")
    return "\n".join(lines)
