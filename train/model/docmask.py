"""Document boundaries in a training micro-batch: labels, loss mask, per-document positions, attention.

Two batch shapes reach the trainer. Pretraining rows are int64 [B, seq_len + 1] token windows; with
`data.document_masking` their documents are found from EOS (a token after an EOS starts a new document,
as Megatron-LM's `reset_position_ids` / `reset_attention_mask` do). Packed rows from
storage.loader.conversations are int64 [B, 4, seq_len]: tokens, labels, loss mask, segment ids (-1 for
padding). `micro_batch` turns either into a `MicroBatch`.

With documents, positions restart at 0 in every document and a token attends only to earlier tokens of
its own document. Transformer Engine gets that as `PackedSeqParams` (the `thd` varlen format: the
micro-batch's rows are laid end to end as one sequence cut at `cu_seqlens`), the local layer spec (CPU)
as an explicit [B, 1, S, S] mask (True = masked) plus per-token RoPE positions (`rope_positions`, which
steers megatron's RotaryEmbedding with its own arithmetic).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch


@dataclass
class MicroBatch:
    tokens: torch.Tensor                 # [B, S] model inputs ([1, B·S] under thd)
    labels: torch.Tensor                 # [B, S]
    loss_mask: torch.Tensor | None       # [B, S] float 0/1; None: every position
    positions: torch.Tensor | None       # [B, S] RoPE positions; None: 0 .. S-1
    attention_mask: torch.Tensor | None  # [B, 1, S, S] bool, True = masked; None: causal
    packed_seq_params: object | None     # megatron PackedSeqParams (thd) under Transformer Engine
    nonpad: torch.Tensor                 # real (non-padding) tokens (a 0-d tensor: no host sync)


def segments_from_eos(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, S] document index of each token: the count of EOS tokens before it in its row."""
    ends = (tokens == eos_id).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends


def positions_of(segments: torch.Tensor) -> torch.Tensor:
    """[B, S] position of each token within its segment (segments are runs of equal ids)."""
    B, S = segments.shape
    idx = torch.arange(S, device=segments.device).expand(B, S)
    new = torch.ones_like(segments, dtype=torch.bool)
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    starts = torch.where(new, idx, torch.zeros_like(idx))
    return idx - torch.cummax(starts, dim=1).values


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, True where query i must not see key j: a later position or another segment."""
    S = segments.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=segments.device).triu(1)
    other = segments[:, :, None] != segments[:, None, :]
    return (other | causal)[:, None]


def packed_seq_params(segments: torch.Tensor):
    """PackedSeqParams (thd) for the rows laid end to end: one sequence per segment run, per row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    flat = segments.reshape(-1)
    B, S = segments.shape
    new = torch.ones_like(flat, dtype=torch.bool)
    new[1:] = flat[1:] != flat[:-1]
    new[::S] = True  # every row starts a sequence
    starts = torch.nonzero(new).flatten()
    cu = torch.cat([starts, torch.tensor([B * S], device=flat.device)]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def micro_batch(batch: torch.Tensor, *, document_masking: bool, eos_id: int | None, varlen: bool) -> MicroBatch:
    """The model inputs of one micro-batch (already on the device). `varlen`: Transformer Engine's thd path."""
    if batch.dim() == 3:  # packed documents
        tokens, labels, loss_mask, segments = (batch[:, i].contiguous() for i in range(4))
        loss_mask = loss_mask.float()
        nonpad = (segments >= 0).sum()
        segments = torch.where(segments < 0, segments.max() + 1, segments)  # padding: its own segment
    else:
        tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        loss_mask, nonpad = None, torch.tensor(tokens.numel(), device=tokens.device)
        if not document_masking:
            return MicroBatch(tokens, labels, None, None, None, None, nonpad)
        if eos_id is None:
            raise ValueError("document masking needs the tokenizer's EOS id")
        segments = segments_from_eos(tokens, eos_id)
    if not document_masking:
        return MicroBatch(tokens, labels, loss_mask, None, None, None, nonpad)
    if varlen:
        n = tokens.numel()
        return MicroBatch(tokens.reshape(1, n), labels.reshape(1, n),
                          None if loss_mask is None else loss_mask.reshape(1, n), None, None,
                          packed_seq_params(segments), nonpad)
    return MicroBatch(tokens, labels, loss_mask, positions_of(segments), block_causal_mask(segments), None, nonpad)


@contextlib.contextmanager
def rope_positions(model_chunks: list):
    """While active, `box["positions"]` ([B, S], or None) replaces RoPE's 0 .. S-1 in every chunk."""
    from megatron.core.utils import unwrap_model

    box: dict = {"positions": None}
    undo = []
    for c in unwrap_model(model_chunks):
        rope = getattr(c, "rotary_pos_emb", None)
        if rope is not None:
            if getattr(rope, "rotary_interleaved", False):
                raise NotImplementedError("per-token positions with interleaved RoPE")
            rope.forward = partial(_rope_forward, rope, rope.forward, box)
            undo.append(rope)
    try:
        yield box
    finally:
        for rope in undo:
            del rope.forward


def _rope_forward(rope, orig, box, max_seq_len, *args, **kwargs):
    pos = box["positions"]
    if pos is None:
        return orig(max_seq_len, *args, **kwargs)
    inv = rope.inv_freq
    seq = pos.to(device=inv.device, dtype=inv.dtype)
    if rope.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rope.seq_len_interpolation_factor)
    freqs = seq[..., None] * inv  # [B, S, dim/2], megatron's get_emb arithmetic per token
    return torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]  # [S, B, 1, dim]
