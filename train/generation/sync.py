"""The weights of the Megatron model in memory (any TP × PP × DP layout) as a transformers model, for
generation while training (in-loop generative evaluation, RL rollouts) and for generative evaluation of a
checkpoint loaded into the Megatron model (`train eval`).

Every rank takes its main-replica pieces from megatron's sharded state dict (the regions a checkpoint
would write: TP slices, the SwiGLU halves, pipeline stages; DP replicas send nothing), the pieces are
gathered on one rank and assembled into whole tensors by global region, then renamed into Llama's layout
by the same mapping as the HF export (train.checkpoint.export_hf.to_llama).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from train.checkpoint.export_hf import hf_config, to_llama
from train.generation.load import hf_model


def full_tensors(chunks: list, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Whole model tensors by checkpoint key (layers stacked on axis 0), on rank `dst`; None elsewhere."""
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.utils import unwrap_model

    from train.checkpoint.strategies import main_pieces

    pieces = []
    for m in unwrap_model(chunks):
        sd = m.sharded_state_dict()
        apply_factories(sd)
        pieces += [(p.key, tuple(p.global_shape), tuple(p.global_offset), p.tensor.detach().cpu())
                   for p in main_pieces(sd)]
    world, rank = dist.get_world_size(), dist.get_rank()
    gathered = [None] * world if rank == dst else None
    if world == 1:
        gathered[0] = pieces  # (gather_object would pickle every tensor only to unpickle it here)
    else:
        dist.gather_object(pieces, gathered, dst=dst)
    if rank != dst:
        return None
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for rank_pieces in gathered:
        for key, shape, offset, t in rank_pieces:
            full = out.setdefault(key, torch.empty(shape, dtype=t.dtype))
            ext = [1] * (len(shape) - t.dim()) + list(t.shape)  # pieces may omit the stacked-layer axes
            full[tuple(slice(o, o + e) for o, e in zip(offset, ext))] = t.reshape(ext)
            filled[key] = filled.get(key, 0) + t.numel()
    short = {k: (filled[k], v.numel()) for k, v in out.items() if filled[k] != v.numel()}
    if short:
        raise RuntimeError(f"model pieces do not cover the tensors (filled, size): {short}")
    return out


def hf_weights(chunks: list, model_cfg, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Llama-named float32 tensors of the model in memory, on rank `dst` (None elsewhere)."""
    t = full_tensors(chunks, dst)
    if t is None:
        return None
    m = model_cfg.resolved()
    return {k: v.float() for k, v in to_llama(t, m.num_heads, m.num_kv_heads).items()}


class HFMirror:
    """A transformers copy of the Megatron model on rank `dst`, refreshed by `sync()` (every rank calls it)."""

    def __init__(self, model_cfg, dst: int = 0):
        self.model_cfg, self.dst = model_cfg, dst
        self.model = None

    def sync(self, chunks: list):
        """The mirror with the current weights on rank dst (None on the other ranks)."""
        w = hf_weights(chunks, self.model_cfg, self.dst)
        if w is None:
            return None
        if self.model is None:
            s = self.model_cfg.resolved().__dict__
            self.model = hf_model(hf_config(w, s, {"name": "in-memory", "step": None, "kind": "live"}), w)
        else:
            self.model.load_state_dict(w, strict=False)
            self.model.tie_weights()
        return self.model
