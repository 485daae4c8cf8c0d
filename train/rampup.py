"""Batch-size ramp-up (`parallel.batch_rampup`): the global batch of each step.

Sizes come from megatron-core's `RampupBatchsizeNumMicroBatchesCalculator` (Megatron-LM's
`--rampup-batch-size START INCREMENT SAMPLES`, with SAMPLES = over_tokens // data.seq_len): a step that
follows c consumed sequences has `start + increment · ⌊c / (SAMPLES / n)⌋` sequences, n = (global − start)
/ increment ramp steps, and parallel.global_batch_size once c > SAMPLES. The size is a function of the
sequences consumed (train state), so a run resumed in the middle of a ramp takes the same sizes.

Data: with a ramp the loader hands out units of micro_batch_size × DP sequences (one micro-batch per DP
rank, the layout of Megatron-LM's pretraining sampler) and a step takes as many units as its batch needs,
so the global sequence order is the loader's, ramp or not: a step of b sequences after c takes [c, c + b).

LR: with a ramp the schedule runs on sequences, as Megatron-LM's sample-based schedule: a step's LR is
`lr_at` of its position in full batches, (sequences consumed by accepted steps + this step's batch) /
global_batch_size − 1, over the run's total sequences / global_batch_size. Without a ramp that position
is the step count, and the schedule is the step schedule exactly.
"""
from __future__ import annotations

import torch

from train.config import ParallelConfig


class BatchSizes:
    """Global batch (sequences) per step, for `dp` data-parallel ranks."""

    def __init__(self, p: ParallelConfig, seq_len: int, dp: int, rank: int = 0):
        self.full = p.global_batch_size
        self.unit = p.micro_batch_size * dp  # what the loader hands out per call when ramping
        self._calc = None
        r = p.batch_rampup
        if r is not None:
            from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

            self._calc = RampupBatchsizeNumMicroBatchesCalculator(
                global_batch_size=self.full, micro_batch_size=p.micro_batch_size, data_parallel_size=dp,
                decrease_batch_size_if_needed=False, rank=rank, start_global_batch_size=r.start,
                batch_size_increment=r.increment, ramup_samples=r.over_tokens // seq_len)

    @property
    def ramping(self) -> bool:
        return self._calc is not None

    def at(self, consumed: int) -> int:
        """The global batch of the step that follows `consumed` sequences."""
        if self._calc is None:
            return self.full
        self._calc.update(consumed, consistency_check=True)
        return self._calc.get_current_global_batch_size()

    def take(self, loader, gbs: int):
        """This rank's rows of the next global batch of `gbs` sequences from `loader` (train.data's)."""
        if self._calc is None:
            return next(loader)
        return torch.cat([next(loader) for _ in range(gbs // self.unit)])

    def total(self, steps: int) -> int:
        """Sequences that `steps` steps from the start consume."""
        consumed = 0
        for i in range(steps):
            b = self.at(consumed)
            if b == self.full:  # the ramp is over: the rest are full batches
                return consumed + (steps - i) * b
            consumed += b
        return consumed
