"""Everything a checkpoint must capture of a training run, gathered in one place by the Trainer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Live training state. The checkpoint module saves and restores it in place.

    model: megatron model chunks (list, one per virtual pipeline stage; DDP-wrapped);
    optimizer: megatron optimizer (plain or distributed); scheduler: LR scheduler with
    state_dict()/load_state_dict(); loader: the streaming loader (state_dict()/load_state_dict(),
    DP-independent); objective: the train.objectives.Objective (state_dict()/load_state_dict(): the state
    it keeps, e.g. of models it owns), or None; step: optimizer steps done; consumed_tokens: global tokens consumed;
    extra: small trainer-owned state (skipped-step counters, loss-spike window, ...), JSON-serialisable.
    RNG states (python, numpy, torch CPU/CUDA, megatron's tracker) are captured by the checkpoint module.
    """
    model: list
    optimizer: Any
    scheduler: Any
    loader: Any
    objective: Any = None
    step: int = 0
    consumed_tokens: int = 0
    extra: dict = field(default_factory=dict)
