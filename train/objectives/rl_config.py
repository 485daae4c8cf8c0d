"""The `rl:` section of the training config (objectives grpo, rloo, ppo; train.objectives.rl). Kept free of
torch imports, so validating a config stays fast."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from storage.config import ConfigError
from train.objectives.rewards import RewardSpec


@dataclass
class RLConfig:
    group_size: int = 8              # completions per prompt (grpo, rloo: a group >= 2; ppo: any)
    max_new_tokens: int = 128        # completion budget (dr_grpo's max_completion_length)
    temperature: float = 1.0         # sampling temperature; log-probs are of logits / temperature (as TRL)
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings (the template's end-of-turn token and EOS always stop)
    # dapo: token sum / global token count (TRL's default); grpo: mean of per-sequence means; dr_grpo: sum /
    # (sequences × max_new_tokens); bnpo: mean of micro-batch token means
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"
    eps_low: float = 0.2             # clip range below 1 of the ratio
    eps_high: float = 0.2            # clip range above 1 (DAPO's clip-higher: 0.28)
    kl_coef: float = 0.0             # KL to the frozen reference (source documents: 0.1-0.2; TRL GRPO 0.0, PPO 0.05, OpenRLHF 0.01, verl 0.001)
    kl: Literal["k1", "k2", "k3"] = "k3"  # KL estimator
    kl_bias_correction: bool = True  # multiply the KL term by the ratio (TRL's use_bias_correction_kl)
    entropy_coef: float = 0.0        # entropy bonus: loss −= coef × token mean of the policy's entropy (off in every peer)
    scale_rewards: bool = True       # grpo: divide by the group's std; false: Dr. GRPO
    whiten_rewards: bool = False     # rewards → (r − mean) / std over the step before the advantages
    whiten_advantages: bool = False  # advantages → (a − mean) / std over the step
    reward_clip: float | None = 10.0  # clip the summed reward to ±this (OpenRLHF); null: off
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])  # summed with their weights
    reference: str | None = None     # the frozen KL reference; null: the --init checkpoint
    eval_prompts: int = 64           # held-out prompts scored greedily at each in-loop evaluation (0: none)
    backend: Literal["auto", "continuous", "padded", "vllm"] = "auto"  # generation engine (train.generation.engine)
    gamma: float = 1.0               # ppo: discount
    lam: float = 0.95                # ppo: GAE lambda
    value_clip: float = 0.2          # ppo: clip of the value update
    value_coef: float = 0.1          # ppo: weight of the value loss

    def check(self, objective: str) -> None:
        """Checks for an RL objective (not run for the others: the section is then unused)."""
        if objective in ("grpo", "rloo") and self.group_size < 2:
            raise ConfigError(f"key 'rl.group_size': {objective} compares completions of one prompt, it needs a group "
                              f"of >= 2, got {self.group_size}")
        if self.group_size < 1:
            raise ConfigError(f"key 'rl.group_size': must be >= 1, got {self.group_size}")
        for k in ("max_new_tokens",):
            if getattr(self, k) < 1:
                raise ConfigError(f"key 'rl.{k}': must be >= 1, got {getattr(self, k)}")
        if self.temperature <= 0:
            raise ConfigError(f"key 'rl.temperature': RL samples, it must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"key 'rl.top_p': must be in (0, 1], got {self.top_p}")
        for k in ("eps_low", "eps_high", "kl_coef", "entropy_coef", "value_clip", "value_coef"):
            if getattr(self, k) < 0:
                raise ConfigError(f"key 'rl.{k}': must be >= 0, got {getattr(self, k)}")
        if self.reward_clip is not None and self.reward_clip <= 0:
            raise ConfigError(f"key 'rl.reward_clip': must be > 0 or null, got {self.reward_clip}")
        if not self.rewards:
            raise ConfigError("key 'rl.rewards': at least one reward")
        for i, r in enumerate(self.rewards):
            r.check(f"rl.rewards.{i}")
        if self.eval_prompts < 0:
            raise ConfigError(f"key 'rl.eval_prompts': must be >= 0, got {self.eval_prompts}")


@dataclass
class RewardModelConfig:
    """`objective: reward`: a scalar head on the policy architecture, trained on preference pairs with the
    Bradley-Terry loss −log σ(r_chosen − r_rejected − margin) (+ center_coef · (r_chosen + r_rejected)²)."""
    margin: float = 0.0              # a constant margin the chosen reward must exceed the rejected one by
    center_coef: float = 0.0         # TRL's center_rewards_coefficient (e.g. 0.01): keeps rewards centred on 0

    def validate(self) -> None:
        if self.center_coef < 0:
            raise ConfigError(f"key 'reward.center_coef': must be >= 0, got {self.center_coef}")
