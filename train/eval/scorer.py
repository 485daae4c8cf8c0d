"""One batched scorer for every evaluation: summed token log-probs of given spans of given rows, computed
by the Megatron model (any TP × PP × DP layout) in forward-only mode.

A `Row` is a sequence of input tokens with their targets, and the spans whose target log-probs are
summed. A row may be a *tree*: a shared prefix followed by branches, each branch attending to the prefix
and causally to itself, with its own positions (this is how the candidates of a multiple-choice item
share one encoding of their context). Trees use an explicit attention mask and per-token RoPE positions,
which the local layer spec supports; under Transformer Engine, items are scored one row per candidate.

Rows are split over DP ranks (round robin over rows sorted by length, so ranks get equal work), sorted by
length and batched under a token budget, so padding stays small; every rank gets every result back.
Sums are float64 in a fixed order, so a row's score does not depend on the batch it lands in beyond
the last bits of float32 arithmetic (`tests/train/test_eval_scorer.py` bounds it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from train.model.docmask import _rope_forward


PAD_RATIO = 0.8


@dataclass
class Row:
    tokens: list[int]                       # model inputs
    labels: list[int]                       # target of each input position (same length)
    spans: list[tuple[int, int]]            # [start, end) positions whose target log-probs are summed
    positions: list[int] | None = None      # RoPE positions (None: 0 .. len-1)
    branches: list[tuple[int, int]] = field(default_factory=list)  # tree: [start, end) of each branch


def tree_row(inputs: list[list[int]], labels: list[list[int]], scored: list[int]) -> Row:
    """Candidates j with inputs[j]/labels[j] whose last scored[j] positions are scored, as one tree row:
    the longest common prefix that ends before any scored position is encoded once."""
    p = min(len(x) - s for x, s in zip(inputs, scored))
    first = inputs[0]
    common = 0
    while common < p and all(len(x) > common and x[common] == first[common] for x in inputs):
        common += 1
    tokens, labs, pos, spans, branches = list(first[:common]), list(labels[0][:common]), list(range(common)), [], []
    for x, y, s in zip(inputs, labels, scored):
        start = len(tokens)
        tokens += x[common:]
        labs += y[common:]
        pos += range(common, len(x))
        branches.append((start, len(tokens)))
        spans.append((len(tokens) - s, len(tokens)))
    return Row(tokens, labs, spans, pos, branches)


def flat_rows(inputs: list[list[int]], labels: list[list[int]], scored: list[int]) -> list[Row]:
    """The same candidates as one causal row each (Transformer Engine path)."""
    return [Row(list(x), list(y), [(len(x) - s, len(x))]) for x, y, s in zip(inputs, labels, scored)]


def supports_trees(model_chunks: list) -> bool:
    """Explicit masks reach the softmax only in megatron's local DotProductAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import unwrap_model

    cores = [m for c in unwrap_model(model_chunks) for m in c.modules()
             if type(m).__name__.endswith("DotProductAttention")]
    return bool(cores) and all(type(m) is DotProductAttention for m in cores)


def length_batches(order: list[int], lengths: list[int], batch_tokens: int, max_rows: int | None = None,
                   pad_ratio: float = PAD_RATIO) -> list[list[int]]:
    """Greedy batches of `order` (longest first) with rows × longest ≤ batch_tokens (≥ 1 row each); a row
    shorter than `pad_ratio` × its batch's longest starts a new batch, so padding stays under ~1/4 of any
    batch. Shared by the Megatron scorer and the transformers backend (train.eval.hf)."""
    out, cur, longest = [], [], 0
    for i in order:
        n = lengths[i]
        if cur and (max(longest, n) * (len(cur) + 1) > batch_tokens or len(cur) == max_rows
                    or n < pad_ratio * longest):
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def _tensors(rows: list[Row], pad_to: int, n_rows: int) -> dict:
    """Right-padded inputs, labels, positions, (for trees) a [B, 1, S, S] mask (True = masked), and the
    scored positions when they are a minority (the output layer then runs on those alone)."""
    B, S = n_rows, pad_to
    tokens = torch.zeros(B, S, dtype=torch.long)
    labels = torch.zeros(B, S, dtype=torch.long)
    need_pos = any(r.positions is not None for r in rows)
    positions = torch.arange(S).repeat(B, 1)
    mask = None
    select = torch.zeros(B, S, dtype=torch.bool)
    for b, r in enumerate(rows):
        for a, e in r.spans:
            select[b, a:e] = True
    if mask is None and int(select.sum()) * 2 > B * S:
        select = None
    if any(r.branches for r in rows):
        mask = torch.ones(B, 1, S, S, dtype=torch.bool)
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)
        mask[:] = causal
    for b, r in enumerate(rows):
        n = len(r.tokens)
        tokens[b, :n] = torch.tensor(r.tokens)
        labels[b, :n] = torch.tensor(r.labels)
        if r.positions is not None:
            positions[b, :n] = torch.tensor(r.positions)
        if mask is not None and r.branches:
            prefix = r.branches[0][0]
            mask[b, 0, prefix:, prefix:] = True  # branches see the prefix, and themselves causally
            for a, e in r.branches:
                mask[b, 0, a:e, a:e] = causal[: e - a, : e - a]
    return {"tokens": tokens, "labels": labels, "positions": positions if need_pos else None, "mask": mask,
            "select": select}


@contextlib.contextmanager
def scoring_hooks(model_chunks: list):
    """While active, per micro-batch values in the returned dict steer the chunks:
    - `positions` ([B, S]): RoPE takes these per-token positions instead of 0 .. S-1 (train.model.docmask);
    - `select` ([B, S] bool): only these positions go through the output layer and the cross entropy
      (the others get loss 0), so long contexts do not pay for vocabulary-sized logits they never use."""
    from megatron.core.utils import unwrap_model

    box: dict = {"positions": None, "select": None}
    undo = []
    for c in unwrap_model(model_chunks):
        rope = getattr(c, "rotary_pos_emb", None)
        if rope is not None:
            if getattr(rope, "rotary_interleaved", False):
                raise NotImplementedError("per-token positions with interleaved RoPE")
            rope.forward = partial(_rope_forward, rope, rope.forward, box)
            undo.append((rope, "forward"))
        if getattr(c, "post_process", False):
            c.output_layer.forward = partial(_output_forward, c.output_layer.forward, box)
            c.compute_language_model_loss = partial(_selected_loss, c.compute_language_model_loss, box)
            undo += [(c.output_layer, "forward"), (c, "compute_language_model_loss")]
    try:
        yield box
    finally:
        for obj, name in undo:
            delattr(obj, name)


def _output_forward(orig, box, hidden_states, *args, **kwargs):
    sel = box["select"]
    if sel is None:
        return orig(hidden_states, *args, **kwargs)
    return orig(hidden_states[sel.transpose(0, 1)].unsqueeze(1), *args, **kwargs)  # [N, 1, h] → [N, 1, V/tp]


def _selected_loss(orig, box, labels, logits):
    sel = box["select"]
    if sel is None:
        return orig(labels, logits)
    sel_sb = sel.transpose(0, 1)  # the hidden states were picked in [S, B] order
    picked = orig(labels.transpose(0, 1)[sel_sb].unsqueeze(0), logits)  # [1, N]
    full = torch.zeros(sel_sb.shape, dtype=picked.dtype, device=picked.device)
    full[sel_sb] = picked[0]
    return full.transpose(0, 1)


class Scorer:
    """Forward-only scoring with the trainer's (or `train eval`'s) model chunks under its parallel layout."""

    def __init__(self, model_chunks: list, par, batch_tokens: int = 8192, max_rows: int = 64):
        self.model, self.par = model_chunks, par
        self.batch_tokens, self.max_rows = batch_tokens, max_rows

    def score(self, rows: list[Row]) -> list[list[float]]:
        """Per row, per span: the summed target log-probs (float64), identical on every rank."""
        from megatron.core import parallel_state as ps

        par = self.par
        by_len = sorted(range(len(rows)), key=lambda i: (-len(rows[i].tokens), i))
        mine = by_len[par.dp_rank::par.dp]
        results: dict[int, list[float]] = {}
        was_training = [m.training for m in self.model]
        for m in self.model:
            m.eval()
        try:
            with torch.no_grad(), scoring_hooks(self.model) as box:
                lengths = [len(r.tokens) for r in rows]
                for batch in length_batches(mine, lengths, self.batch_tokens, self.max_rows):
                    out = self._run([rows[i] for i in batch], box)
                    if out is not None:
                        for i, lp in zip(batch, out):
                            results[i] = [float(np.sum(lp[a:e], dtype=np.float64)) for a, e in rows[i].spans]
        finally:
            for m, t in zip(self.model, was_training):
                m.train(t)
        holder = results if (par.is_last_stage and ps.get_tensor_model_parallel_rank() == 0) else {}
        gathered: list = [None] * dist.get_world_size() if dist.is_initialized() else [holder]
        if dist.is_initialized():
            dist.all_gather_object(gathered, holder)
        merged: dict[int, list[float]] = {}
        for g in gathered:
            merged.update(g)
        missing = [i for i in range(len(rows)) if i not in merged]
        if missing:
            raise RuntimeError(f"scorer: {len(missing)} rows without a result (first: {missing[0]})")
        return [merged[i] for i in range(len(rows))]

    def _run(self, rows: list[Row], box: dict) -> list[np.ndarray] | None:
        """One batch through the pipeline; per-row float32 log-probs on the last stage, else None."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        par = self.par
        S = max(len(r.tokens) for r in rows)
        k = min(par.pp, len(rows)) if par.pp > 1 else 1  # micro-batches keep every stage busy
        mbs = -(-len(rows) // k)
        t = _tensors(rows, S, mbs * k)
        micro = [{key: (v[j * mbs:(j + 1) * mbs] if v is not None else None) for key, v in t.items()}
                 for j in range(k)]

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            dev = par.device
            box["positions"] = mb["positions"].to(dev) if mb["positions"] is not None else None
            box["select"] = mb["select"].to(dev) if mb["select"] is not None else None
            mask = mb["mask"].to(dev) if mb["mask"] is not None else None
            tokens = mb["tokens"].to(dev)
            pos = torch.arange(S, device=dev).unsqueeze(0).expand_as(tokens)
            out = model(tokens, pos, mask, labels=mb["labels"].to(dev))
            return out, _collect

        stores = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=self.model, num_microbatches=k,
            seq_length=S, micro_batch_size=mbs, forward_only=True)
        box["positions"] = box["select"] = None
        if not par.is_last_stage:
            return None
        lp = torch.cat([s["logprobs"] for s in stores]).cpu().numpy()
        return [lp[b, :len(r.tokens)] for b, r in enumerate(rows)]


def _collect(token_losses: torch.Tensor):
    lp = -token_losses.detach().float()
    return lp.sum(), torch.tensor(lp.numel(), dtype=torch.int, device=lp.device), {"logprobs": lp}

