"""Preference-optimization losses (objective dpo): DPO (sigmoid), IPO, APO-zero, APO-down, as the papers
define them and TRL's `DPOTrainer` implements them (tests/train/test_preference_loss.py compares both).

Inputs are per-pair summed completion log-probs of the policy and of the reference (chosen and rejected),
and the completion token counts (IPO length-normalises). With r_w = log pi(y_w) - log pi_ref(y_w),
r_l likewise and Delta = r_w - r_l:
- sigmoid: -(1 - e) log sigmoid(beta Delta) - e log sigmoid(-beta Delta)   (e: label smoothing)
- ipo:     (r_w / |y_w| - r_l / |y_l| - 1 / (2 beta))^2
- apo_zero: (1 - sigmoid(beta r_w)) + sigmoid(beta r_l)
- apo_down: sigmoid(beta r_w) + (1 - sigmoid(beta Delta))
plus, with rpo_alpha > 0, alpha times the chosen completion's mean token NLL (RPO; per pair, normalised by
its own length as the RPO paper writes it). The trainer sums per-pair losses per micro-batch and megatron
divides the gradients by the global number of pairs in the step, so the loss is the mean over pairs
whatever the micro-batch size or layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from train.objectives.preference_config import LOSSES, DPOConfig

# summed per micro-batch into the step report, after (loss, pairs, non-padding tokens)
METRICS = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "logps_chosen", "logps_rejected")


def pair_losses(cfg: DPOConfig, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                rejected_tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair losses [P], per-pair metrics {name: [P]}) from per-pair summed log-probs."""
    beta = cfg.beta
    r_w, r_l = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    delta = r_w - r_l
    if cfg.loss == "sigmoid":
        e = cfg.label_smoothing
        loss = -F.logsigmoid(beta * delta) * (1 - e) - F.logsigmoid(-beta * delta) * e
    elif cfg.loss == "ipo":
        ipo = r_w / chosen_tokens.clamp(min=1) - r_l / rejected_tokens.clamp(min=1)
        loss = (ipo - 1 / (2 * beta)) ** 2
    elif cfg.loss == "apo_zero":
        loss = (1 - torch.sigmoid(beta * r_w)) + torch.sigmoid(beta * r_l)
    elif cfg.loss == "apo_down":
        loss = torch.sigmoid(beta * r_w) + (1 - torch.sigmoid(beta * delta))
    else:
        raise ValueError(f"unknown preference loss {cfg.loss!r}; known: {', '.join(LOSSES)}")
    if cfg.rpo_alpha:
        loss = loss + cfg.rpo_alpha * (-policy_chosen / chosen_tokens.clamp(min=1))
    with torch.no_grad():
        rc, rr = beta * r_w.detach(), beta * r_l.detach()
        metrics = {"rewards_chosen": rc, "rewards_rejected": rr, "reward_accuracy": (rc > rr).to(rc.dtype),
                   "logps_chosen": policy_chosen.detach(), "logps_rejected": policy_rejected.detach()}
    return loss, metrics


def sequence_logps(token_losses: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-probs, completion token counts) per row from megatron's per-token losses."""
    mask = loss_mask.reshape(token_losses.shape).to(token_losses.dtype)
    return -(token_losses * mask).sum(dim=1), mask.sum(dim=1)
