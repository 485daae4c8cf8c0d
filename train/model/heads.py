"""Scalar heads on the GPT trunk: a reward model's score (the head replaces the language-model output) and
PPO's value head (beside it). A head is a bias-free Linear(hidden, 1) on the last pipeline stage, applied
to the final hidden states (after the last norm, where the output layer reads them); it is a submodule of
the GPTModel, so DDP, the optimizer and checkpoints (megatron's sharded state dict, replicated over TP)
carry it like any parameter.

The output layer's `forward` is replaced on the instance, so its weight (tied to the embedding) stays where
megatron's tied-embedding gradient sync expects it:
- `replace=True`: the model returns scores [B, S, 1] instead of logits (no vocabulary GEMM);
- `replace=False`: the model returns logits as before and the values [B, S] of the same forward pass land in
  `box["values"]` (read by the loss function of that micro-batch).

`logits_at_positions` wraps the output layer the same way for a caller that needs logits at a few positions
only (RL: the completion tokens, a fifth of a row or less): it hands the output layer just those hidden
states, as megatron's own inference path hands it only the last token's, so neither the vocabulary GEMM
nor anything after it runs on the rest.
"""
from __future__ import annotations

import hashlib

import torch


class ScalarHead(torch.nn.Module):
    def __init__(self, hidden: int, seed: int, name: str, std: float = 0.02):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden))
        g = torch.Generator().manual_seed((seed * 1_000_003 + int(hashlib.sha1(name.encode()).hexdigest()[:12], 16))
                                          % (2**63))
        with torch.no_grad():
            self.weight.copy_(torch.randn(1, hidden, generator=g) * std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.to(hidden.dtype).t()


def attach(chunk, name: str, *, seed: int, replace: bool, box: dict | None = None) -> ScalarHead | None:
    """Add head `name` to a GPTModel chunk (a no-op off the last pipeline stage); see the module doc."""
    if not getattr(chunk, "post_process", False):
        return None
    hidden = chunk.config.hidden_size
    head = ScalarHead(hidden, seed, name)
    if next(chunk.parameters()).is_cuda:
        head.cuda(next(chunk.parameters()).device)
    head.to(next(chunk.parameters()).dtype)
    chunk.add_module(name, head)
    out = chunk.output_layer
    original = out.forward

    def forward(hidden_states, weight=None, runtime_gather_output=None):
        score = head(hidden_states)  # [S, B, 1]
        if replace:
            return score, None
        box["values"] = score[..., 0].transpose(0, 1).float()  # [B, S]
        return original(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)

    out.forward = forward
    return head


def logits_at_positions(chunk) -> None:
    """After this, `chunk.logit_positions = mask` ([B, S] bool) before a forward makes the model return the
    logits at the set positions only, [1, N, V] in row-major order of the mask (the mask is consumed by that
    forward; without one the model returns [B, S, V] as before). A no-op off the last pipeline stage. Call it
    before attaching a head with `replace=False`, so that the head still reads every position."""
    if not getattr(chunk, "post_process", False) or getattr(chunk, "_logits_at_positions", False):
        return
    out = chunk.output_layer
    original = out.forward

    def forward(hidden_states, weight=None, runtime_gather_output=None):
        at = chunk.__dict__.pop("logit_positions", None)
        if at is not None:  # [S, B, H] → [N, 1, H]
            hidden_states = hidden_states.transpose(0, 1)[at].unsqueeze(1)
        return original(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)

    out.forward = forward
    chunk._logits_at_positions = True
