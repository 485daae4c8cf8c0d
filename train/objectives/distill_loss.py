"""Distillation losses on vocabulary-split logits (tensor parallel): TRL's generalized Jensen-Shannon
divergence per token, over the whole vocabulary or over the teacher's k most likely tokens.

Per token, with both logits divided by the temperature T (TRL 1.16 `GKDTrainer.generalized_jsd_loss`):
β = 0 is the forward KL(teacher ‖ student), β = 1 the reverse KL(student ‖ teacher), otherwise
β·KL(teacher ‖ m) + (1 − β)·KL(student ‖ m) with m = β·teacher + (1 − β)·student. No T² factor (as TRL).

Under TP each rank holds a slice of the vocabulary. The log-normaliser of a distribution is the log of an
all-reduced sum whose backward all-reduces too (`torch.distributed.nn.functional.all_reduce`), because the
local terms that use it are partial sums; the per-token divergence is the all-reduce (forward only: megatron's
`reduce_from_tensor_model_parallel_region`) of the local sums over the vocabulary, identical on every TP rank.
The embedding's padding rows (ids >= vocab) are excluded from both distributions.

Top-k: both distributions are restricted to the teacher's k most likely tokens and renormalised there, i.e.
the loss is the same function of the teacher's top-k logits and the student's logits at those ids (gathered
across TP ranks: each rank contributes the ids in its slice).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

NEG = -1e30  # "minus infinity" that keeps 0 · (a − b) finite in the KL terms


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """Elementwise generalized JSD terms (sum them over the vocabulary) of two log-distributions, exactly
    TRL's `F.kl_div(..., reduction="none", log_target=True)` forms."""
    if beta == 0:
        return F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(teacher_logp, student_logp, reduction="none", log_target=True)
    b = torch.tensor(beta, dtype=student_logp.dtype, device=student_logp.device)
    mix = torch.logsumexp(torch.stack([student_logp + torch.log1p(-b), teacher_logp + torch.log(b)]), dim=0)
    return b * F.kl_div(mix, teacher_logp, reduction="none", log_target=True) + \
        (1 - b) * F.kl_div(mix, student_logp, reduction="none", log_target=True)


def _tp():
    """(group, size, rank) of the tensor-parallel group; (None, 1, 0) without megatron's parallel state."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 1, 0
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_rank()


def _mask_padding(z: torch.Tensor, vocab: int, start: int) -> torch.Tensor:
    if start + z.shape[-1] <= vocab:
        return z
    keep = max(vocab - start, 0)
    return torch.cat([z[..., :keep], torch.full_like(z[..., keep:], NEG)], -1)


def log_softmax_tp(z: torch.Tensor) -> torch.Tensor:
    """log_softmax over a vocabulary split across the TP ranks (this rank's slice of the result)."""
    group, size, _ = _tp()
    m = z.detach().max(-1, keepdim=True).values
    if size == 1:
        return z - (torch.log((z - m).exp().sum(-1, keepdim=True)) + m)
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_reduce

    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = all_reduce((z - m).exp().sum(-1, keepdim=True), group=group)  # backward: the gradients summed over TP
    return z - (torch.log(s) + m)


def _sum_tp(x: torch.Tensor) -> torch.Tensor:
    _, size, _ = _tp()
    if size == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def full_vocab(student: torch.Tensor, teacher: torch.Tensor, *, beta: float, temperature: float,
               vocab: int) -> torch.Tensor:
    """Per-token divergence [B, S] of this rank's vocabulary slices [B, S, V/tp] (same slicing for both)."""
    _, _, rank = _tp()
    start = rank * student.shape[-1]
    ls = log_softmax_tp(_mask_padding(student.float() / temperature, vocab, start))
    with torch.no_grad():
        lt = log_softmax_tp(_mask_padding(teacher.float() / temperature, vocab, start))
    return _sum_tp(generalized_jsd(ls, lt, beta).sum(-1))


@torch.no_grad()
def teacher_top_k(teacher: torch.Tensor, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, global ids) [B, S, k] of the teacher's k largest logits over the whole (TP-split) vocabulary,
    values in descending order."""
    group, size, rank = _tp()
    start = rank * teacher.shape[-1]
    z = _mask_padding(teacher.float(), vocab, start)
    v, i = z.topk(min(k, z.shape[-1]), dim=-1)
    i = i + start
    if size > 1:
        import torch.distributed as dist

        vs, is_ = [torch.empty_like(v) for _ in range(size)], [torch.empty_like(i) for _ in range(size)]
        dist.all_gather(vs, v.contiguous(), group=group)
        dist.all_gather(is_, i.contiguous(), group=group)
        v, i = torch.cat(vs, -1), torch.cat(is_, -1)
        v, pick = v.topk(k, dim=-1)
        i = i.gather(-1, pick)
    return v, i


def gather_ids(student: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The student's logits at global vocabulary ids [B, S, k] from this rank's slice [B, S, V/tp], the
    same on every TP rank (gradients flow to the rank that holds each id)."""
    _, _, rank = _tp()
    part = student.shape[-1]
    local = ids - rank * part
    inside = (local >= 0) & (local < part)
    got = student.gather(-1, local.clamp(0, part - 1)) * inside
    return _sum_tp(got)


def top_k(student: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, *, beta: float,
          temperature: float) -> torch.Tensor:
    """Per-token divergence [B, S] restricted to the teacher's top-k ids (teacher logits `values`)."""
    zs = gather_ids(student.float(), ids) / temperature
    ls = zs - torch.logsumexp(zs, -1, keepdim=True)
    with torch.no_grad():
        zt = values.float() / temperature
        lt = zt - torch.logsumexp(zt, -1, keepdim=True)
    return generalized_jsd(ls, lt, beta).sum(-1)


def ce_tp(student: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy [B, S] of vocabulary-split logits (megatron's, as pretraining computes it)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(student.float().clone(), labels)  # (it subtracts the max in place)


def beta_of(loss: str, beta: float) -> float:
    return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(loss, beta)

