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


def lr_at(step: float, o: OptimConfig, total_steps: float) -> float:
    """LR for optimizer step `step` (0-based; a fraction of a step under a batch ramp-up, train.rampup):
    linear warmup, then cosine to min_lr, WSD (constant, then linear decay to min_lr over the last
    decay_fraction of steps), or constant."""
    if o.warmup_steps and step < o.warmup_steps:  # a fractional step may end past the warmup: lr then
        return o.lr * (step + 1) / o.warmup_steps if step + 1 <= o.warmup_steps else o.lr
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
    """Sets the LR and weight decay of every param group for the coming step; state is the count of
    accepted steps and the sequences they consumed.

    Weight decay is optim.weight_decay × the group's `wd_mult`, as megatron's OptimizerParamScheduler sets
    it: megatron's param groups give norm weights and biases (1-D parameters) wd_mult 0, but the torch
    optimizer reads only `weight_decay`, which they are built with at the full value.
    With a batch ramp-up (`batches`, train.rampup.BatchSizes) the schedule runs on sequences."""

    def __init__(self, optimizer, o: OptimConfig, total_steps: int, batches=None):
        self.optimizer, self.o = optimizer, o
        self.batches = batches if batches is not None and batches.ramping else None
        self.total = total_steps if self.batches is None else self.batches.total(total_steps) / self.batches.full
        self.step_count = self.sequences = 0

    def apply(self, batch: int) -> float:
        """Set and return the LR of the coming step, whose global batch is `batch` sequences."""
        pos = self.step_count if self.batches is None else (self.sequences + batch) / self.batches.full - 1
        lr = lr_at(pos, self.o, self.total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.o.weight_decay * group.get("wd_mult", 1.0)
        return lr

    def step(self, batch: int) -> None:
        """The coming step's update was applied (a skipped step does not advance the schedule)."""
        self.step_count += 1
        self.sequences += batch

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "sequences": self.sequences}

    def load_state_dict(self, sd: dict) -> None:
        self.step_count = int(sd["step_count"])
        self.sequences = int(sd.get("sequences", 0))  # absent in checkpoints from before the ramp-up


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
