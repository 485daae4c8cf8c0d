"""Optimizer (megatron AdamW, plain or distributed), LR schedules, gradient clipping and spike detection.

The optimizer step is split so the trainer can look at the loss and the global grad norm *before*
parameters change: `grad_norm(opt)` → decide (non-finite? spike?) → `clip_and_step(opt, norm, clip)`.
"""
from __future__ import annotations

import math
from collections import deque

from train.config import OptimConfig, SpikeConfig, TrainConfig


def build_optimizer(cfg: TrainConfig, model_chunks: list):
    """megatron's optimizer over DDP-wrapped chunks: AdamW (decoupled weight decay), fp32 master weights
    in bf16, state sharded over DP when parallel.distributed_optimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optim
    ocfg = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps,
        clip_grad=o.clip_grad, bf16=cfg.bf16_weights(),
        params_dtype=model_chunks[0].config.params_dtype,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    return get_megatron_optimizer(ocfg, model_chunks)


def lr_at(step: int, o: OptimConfig, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine to min_lr, WSD (constant, then
    linear decay to min_lr over the last decay_fraction of steps), or constant."""
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "cosine":
        span = max(1, total_steps - o.warmup_steps)
        t = min(1.0, (step - o.warmup_steps) / span)
        return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * t))
    decay = round(o.decay_fraction * total_steps)
    start = total_steps - decay
    if decay <= 0 or step < start:
        return o.lr
    t = min(1.0, (step - start + 1) / decay)
    return o.lr + (o.min_lr - o.lr) * t


class LRScheduler:
    """Sets the LR and weight decay of every param group for the coming step; state is the step count.

    Weight decay is optim.weight_decay × the group's `wd_mult`, as megatron's OptimizerParamScheduler sets
    it: megatron's param groups give norm weights and biases (1-D parameters) wd_mult 0, but the torch
    optimizer reads only `weight_decay`, which they are built with at the full value."""

    def __init__(self, optimizer, o: OptimConfig, total_steps: int):
        self.optimizer, self.o, self.total_steps = optimizer, o, total_steps
        self.step_count = 0
        self.lr = lr_at(0, o, total_steps)

    def apply(self) -> float:
        self.lr = lr_at(self.step_count, self.o, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.o.weight_decay * group.get("wd_mult", 1.0)
        return self.lr

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, sd: dict) -> None:
        self.step_count = int(sd["step_count"])


class SpikeDetector:
    """Z-score of a loss against the last `window` accepted losses."""

    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)

    def zscore(self, loss: float) -> float:
        if len(self.history) < max(2, self.cfg.min_history):
            return 0.0
        mean = sum(self.history) / len(self.history)
        var = sum((x - mean) ** 2 for x in self.history) / (len(self.history) - 1)
        return (loss - mean) / max(math.sqrt(var), 1e-8)

    def is_spike(self, loss: float) -> bool:
        return self.zscore(loss) > self.cfg.zscore

    def accept(self, loss: float) -> None:
        self.history.append(loss)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, sd: dict) -> None:
        self.history = deque(sd.get("history", []), maxlen=self.cfg.window)


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def grad_norm(optimizer) -> float:
    """Global L2 grad norm (all-reduced over model-parallel and, with the distributed optimizer, DP
    groups; the same on every rank). Moves grads into main grads first (bf16)."""
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


def clip_and_step(optimizer, norm: float, clip: float) -> None:
    """Clip by the already-computed global norm, then update parameters."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if clip > 0:
        for sub in _sub_optimizers(optimizer):
            params = sub.get_parameters()
            if params and not getattr(sub, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=norm)
    optimizer.step_with_ready_grads()
