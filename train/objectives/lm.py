"""Next-token cross entropy: `pretrain` on a token stream, `sft` on packed whole conversations with a
loss mask (assistant turns) and document masking.

Both return the micro-batch's summed token losses. Pretraining lets megatron divide by tokens and
micro-batches; sft (calculate_per_token_loss) keeps sums, and megatron divides the gradients by the
step's global count of loss tokens, so neither the micro-batch size nor the layout changes the loss.

torch is imported where it is used: `train launch` reads the objective's config-time hooks before any rank
starts, and for pretraining and SFT that process then never imports torch (1.7 s here).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from train.objectives.base import Objective

if TYPE_CHECKING:
    import torch


def model_inputs(mb) -> tuple:
    """(tokens, positions) for GPTModel: per-token RoPE positions are steered by rope_positions, and
    megatron still wants a position tensor."""
    import torch

    positions = mb.positions if mb.positions is not None else \
        torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
    return mb.tokens, positions


def token_loss_report(token_losses: torch.Tensor, mb) -> tuple:
    """(sum, loss tokens, report [sum, loss tokens, non-padding tokens]) of masked token losses."""
    import torch

    losses = token_losses.float()
    if mb.loss_mask is not None:
        losses = losses * mb.loss_mask.reshape(losses.shape)
    total = losses.sum()
    n = torch.tensor(losses.numel(), dtype=torch.int, device=total.device) if mb.loss_mask is None \
        else mb.loss_mask.sum().to(torch.int)
    return total, n, torch.stack([total.detach().double(), n.double(), mb.nonpad.double()])


class Pretrain(Objective):
    name = "pretrain"
    data = "tokens"
    per_token_loss = False

    def forward(self, model, rows, docs: dict, rope: dict):
        from train.model.docmask import micro_batch

        mb = micro_batch(rows, **docs)
        rope["positions"] = mb.positions
        tokens, positions = model_inputs(mb)
        out = model(tokens, positions, mb.attention_mask, labels=mb.labels,  # mask None: the spec's causal mask
                    packed_seq_params=mb.packed_seq_params)
        return out, lambda token_losses: token_loss_report(token_losses, mb)


class SFT(Pretrain):
    name = "sft"
    data = "conversations"
    per_token_loss = True
    document_masking = True

    def log_fields(self, window: list[dict], tokens: int, elapsed: float) -> dict:
        """Padding is computed but not data: report both."""
        nonpad = sum(w["nonpad_tokens"] for w in window)
        return {"nonpad_tokens_per_s": nonpad / elapsed if elapsed > 0 else 0.0,
                "packing_efficiency": nonpad / tokens, "loss_tokens": window[-1]["loss_tokens"]}
