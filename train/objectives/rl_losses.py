"""RL loss forms on per-token tensors, as TRL 1.16 / OpenRLHF / verl write them (tests compare them with
TRL's GRPOTrainer and RewardTrainer and with float64 formulas):

- group advantages: GRPO (r − mean_group) / (std_group + eps) (std division optional: Dr. GRPO), RLOO's
  leave-one-out baseline r − (Σ_group r − r)/(G − 1);
- PPO: GAE over per-token rewards (γ, λ), returns = advantages + values, the clipped value loss
  0.5·max((V − R)², (V_old + clip(V − V_old, ±c) − R)²);
- the clipped policy loss max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)) with ρ = exp(logπ − logπ_old),
  plus a KL penalty to the reference per token (k1 = logπ − logπ_ref, k2 = ½(…)², k3 = e^(ref − logπ) −
  (ref − logπ) − 1; optionally times ρ, TRL's `use_bias_correction_kl`);
- how per-token losses become one loss (TRL's `loss_type`): `dapo` Σ / global token count, `grpo` mean of
  per-sequence token means, `dr_grpo` Σ / (sequences × max_completion_length), `bnpo` mean over
  micro-batches of their token means; the entropy bonus subtracts coef × the token mean of the entropy;
- the reward model's Bradley–Terry loss −log σ(r_c − r_r − margin) + c·mean((r_c + r_r)²).

`token_weights` expresses each aggregation as one weight per token, so that the trainer, which sums a
micro-batch's weighted losses and lets megatron divide by the global count, computes exactly these means
whatever the micro-batch size, DP size or layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
KL_ESTIMATORS = ("k1", "k2", "k3")


def group_advantages(rewards: torch.Tensor, group: int, *, estimator: str = "grpo", scale: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """Per-completion advantages of rewards laid out as consecutive groups of `group` completions."""
    r = rewards.reshape(-1, group).double()
    if estimator == "rloo":
        adv = r - (r.sum(1, keepdim=True) - r) / (group - 1)
    else:
        adv = r - r.mean(1, keepdim=True)
        if scale:  # GRPO; Dr. GRPO leaves the std out
            adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.reshape(-1).to(rewards.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / std over the (masked) entries."""
    if mask is None:
        return (x - x.mean()) / (x.std() + eps)
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) / (var.sqrt() + eps) * m


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """(advantages, returns) [B, T] by generalized advantage estimation over the masked tokens (completion
    tokens are contiguous; V after the last one is 0)."""
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    nxt = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    m = mask.to(rewards.dtype)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = (delta + gamma * lam * last) * m[:, t]
        adv[:, t] = last
        nxt = torch.where(m[:, t] > 0, values[:, t], nxt)
    return adv, (adv + values) * m


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-token clipped value loss 0.5·max((V − R)², (V_old + clip(V − V_old, ±c) − R)²)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d ** 2
    if kind == "k3":
        return torch.exp(-d) + d - 1
    raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *, eps_low: float,
                eps_high: float, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, kl: str = "k3",
                bias_correction: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-token loss [B, T], per-token stats: ratio, clipped (bool), kl). `advantages` is [B, T] or [B, 1]."""
    ratio = torch.exp(logp - old_logp)
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    stats = {"ratio": ratio.detach(),
             "clipped": ((ratio < 1 - eps_low) & (advantages < 0)) | ((ratio > 1 + eps_high) & (advantages > 0))}
    if kl_coef and ref_logp is not None:
        k = kl_estimate(logp, ref_logp, kl)
        stats["kl"] = k.detach()
        loss = loss + kl_coef * (k * ratio if bias_correction else k)
    return loss, stats


def token_weights(mask: torch.Tensor, loss_type: str, *, sequences: int, tokens: int, max_completion_length: int,
                  micro_batches: int = 1) -> torch.Tensor:
    """Per-token weights w with loss = Σ w·ℓ over the global batch. `mask` [B, T] is this micro-batch's; the
    global counts are of the whole step (all micro-batches and DP ranks): `sequences`, `tokens`,
    `micro_batches` (bnpo's local means are per micro-batch)."""
    m = mask.to(torch.float64)
    if loss_type == "dapo":
        return m / max(tokens, 1)
    if loss_type == "grpo":
        return m / m.sum(1, keepdim=True).clamp(min=1) / max(sequences, 1)
    if loss_type == "dr_grpo":
        return m / (max(sequences, 1) * max_completion_length)
    if loss_type == "bnpo":
        return m / m.sum().clamp(min=1) / max(micro_batches, 1)
    raise ValueError(f"unknown loss type {loss_type!r}; known: {', '.join(LOSS_TYPES)}")


def reward_model_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                      center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair Bradley–Terry loss (TRL's RewardTrainer: mean over pairs gives its loss)."""
    d = chosen - rejected - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(d)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss
