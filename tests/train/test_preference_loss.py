"""train.objectives.preference against TRL's DPOTrainer: for every loss type, the loss and its gradient with respect
to the policy's log-probs equal TRL's `_compute_loss` on the same (policy, reference) log-probs."""
from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch
from testutil import require

from train.objectives.preference import pair_losses, sequence_logps
from train.objectives.preference_config import DPOConfig


class _Stub(torch.nn.Module):
    """Stands in for the policy model: returns given per-token log-probs (TRL reads outputs.log_probs)."""

    def __init__(self, per_token_logps: torch.Tensor):
        super().__init__()
        self.logps = per_token_logps

    def forward(self, input_ids=None, labels=None, **kw):
        lp = self.logps * (labels[:, 1:] != -100)
        z = torch.zeros_like(lp)
        return types.SimpleNamespace(log_probs=lp, entropy=z, mean_logits=z, is_top1=z.bool(), aux_loss=None)


def _trl_loss(loss_type: str, beta: float, smoothing: float, logps, completion_mask, ref_c, ref_r):
    require("trl")
    from trl import DPOTrainer

    model = _Stub(logps)
    acc = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t, gather=lambda t: t)
    fake = types.SimpleNamespace(
        model=model, accelerator=acc, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0, loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        ref_model=None, router_aux_loss_coef=0.0)
    ids = torch.ones_like(completion_mask)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion_mask,
              "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    return DPOTrainer._compute_loss(fake, model, inputs, False)


@pytest.mark.parametrize("loss,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("apo_zero", 0.0),
                                            ("apo_down", 0.0)])
def test_loss_and_gradient_equal_trl(loss, smoothing):
    g = torch.Generator().manual_seed(3)
    P, T, beta = 6, 12, 0.1
    # completion masks of different lengths: prompt tokens first, then the completion
    completion = torch.zeros(2 * P, T + 1, dtype=torch.int64)
    for i in range(2 * P):
        start = int(torch.randint(2, 6, (1,), generator=g))
        stop = int(torch.randint(start + 1, T + 1, (1,), generator=g))
        completion[i, start:stop] = 1
    per_token = (-torch.rand(2 * P, T, generator=g, dtype=torch.float64) * 3)
    ref = per_token.detach() * completion[:, 1:] + torch.randn(2 * P, T, generator=g, dtype=torch.float64) * 0.2 \
        * completion[:, 1:]
    ref_seq = ref.sum(1)
    ref_c, ref_r = ref_seq[:P], ref_seq[P:]

    theirs_in = per_token.clone().requires_grad_(True)
    theirs = _trl_loss(loss, beta, 0.0, theirs_in, completion, ref_c, ref_r)
    if smoothing:  # TRL 1.x dropped conservative DPO from "sigmoid": (1 - e) L(chosen, rejected) + e L(swapped)
        swap = torch.cat([torch.arange(P, 2 * P), torch.arange(P)])
        flipped = _trl_loss(loss, beta, 0.0, theirs_in[swap], completion[swap], ref_r, ref_c)
        theirs = (1 - smoothing) * theirs + smoothing * flipped
    theirs.backward()

    # ours: the trainer's path from per-token losses (negated log-probs) and the label mask, rows interleaved
    ours_in = per_token.clone().requires_grad_(True)
    order = torch.stack([torch.arange(P), torch.arange(P, 2 * P)], dim=1).reshape(-1)  # c0 r0 c1 r1 ...
    seq, count = sequence_logps(-ours_in[order], completion[order, 1:])
    cfg = DPOConfig(loss=loss, beta=beta, label_smoothing=smoothing)
    losses, metrics = pair_losses(cfg, seq[0::2], seq[1::2], ref_c, ref_r, count[0::2], count[1::2])
    ours = losses.mean()
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-6, atol=1e-9)
    assert metrics["reward_accuracy"].shape == (P,)


def test_config_errors_name_the_key():
    from storage.config import ConfigError

    for bad, key in ((DPOConfig(beta=0), "dpo.beta"), (DPOConfig(loss="ipo", label_smoothing=0.1), "dpo.label_smoothing"),
                     (DPOConfig(rpo_alpha=-1), "dpo.rpo_alpha")):
        with pytest.raises(ConfigError, match=key):
            bad.validate()
