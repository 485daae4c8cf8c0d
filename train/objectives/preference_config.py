"""The `dpo:` section of a training config (objective dpo): which preference loss, its strength, the
reference. Apart from the losses (train.objectives.preference) so that reading a config imports no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from storage.config import ConfigError

LOSSES = ("sigmoid", "ipo", "apo_zero", "apo_down")


@dataclass
class DPOConfig:
    loss: Literal["sigmoid", "ipo", "apo_zero", "apo_down"] = "sigmoid"  # the preference loss
    beta: float = 0.1                # strength of the reference anchor (IPO: its regulariser tau)
    label_smoothing: float = 0.0     # sigmoid only: assumed share of flipped labels (conservative DPO)
    rpo_alpha: float = 0.0           # > 0: add alpha x the chosen completion's mean token NLL (RPO)
    # precomputed: reference log-probs computed once (`train refs`, or at the start of the run) and stored
    # beside the dataset, one model in memory; online: a frozen copy of the reference in memory
    reference: Literal["precomputed", "online"] = "precomputed"
    reference_checkpoint: str | None = None  # null: the --init checkpoint (the policy's starting weights)

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"key 'dpo.beta': must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"key 'dpo.label_smoothing': must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss != "sigmoid":
            raise ConfigError(f"key 'dpo.label_smoothing': only for loss sigmoid, not {self.loss}")
        if self.rpo_alpha < 0:
            raise ConfigError(f"key 'dpo.rpo_alpha': must be >= 0, got {self.rpo_alpha}")
