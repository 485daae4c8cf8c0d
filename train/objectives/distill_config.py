"""The `distill:` section of the training config (objectives distill and distill_sft; train.objectives.distill).
Kept free of torch imports, so validating a config stays fast."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from storage.config import ConfigError


@dataclass
class DistillConfig:
    teacher: str | None = None       # the teacher: a checkpoint (step folder or run dir) or a Hugging Face folder (imported at launch)
    # forward_kl: KL(teacher ‖ student) (β 0); reverse_kl: KL(student ‖ teacher) (β 1); jsd: TRL's generalized JSD with beta
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = 0.5                # jsd only: the mixture's teacher weight (TRL GKD's beta), in (0, 1)
    temperature: float = 1.0         # both logits divided by it (no T² factor, as TRL)
    ce_weight: float = 0.0           # token loss = (1 − ce_weight)·divergence + ce_weight·cross entropy on the data
    top_k: int | None = None         # the divergence over the teacher's k most likely tokens (renormalised); null: whole vocabulary
    precomputed: bool = False        # read the teacher's top-k from a cache beside the dataset (train teacher-cache; built at the first start if missing) instead of co-hosting it

    def check(self) -> None:
        if not self.teacher:
            raise ConfigError("key 'distill.teacher': objective distill needs a teacher (a checkpoint or a Hugging "
                              "Face folder)")
        if self.loss not in ("forward_kl", "reverse_kl", "jsd"):
            raise ConfigError(f"key 'distill.loss': forward_kl, reverse_kl or jsd, got {self.loss!r}")
        if self.loss == "jsd" and not 0.0 < self.beta < 1.0:
            raise ConfigError(f"key 'distill.beta': jsd needs 0 < beta < 1 (beta 0 is forward_kl, 1 reverse_kl), got "
                              f"{self.beta}")
        if self.temperature <= 0:
            raise ConfigError(f"key 'distill.temperature': must be > 0, got {self.temperature}")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise ConfigError(f"key 'distill.ce_weight': must be in [0, 1], got {self.ce_weight}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"key 'distill.top_k': must be >= 1 or null, got {self.top_k}")
        if self.precomputed and not self.top_k:
            raise ConfigError("key 'distill.precomputed': needs distill.top_k (the cache keeps the teacher's k most "
                              "likely tokens per position, not the whole vocabulary)")
