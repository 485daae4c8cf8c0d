"""`objective: reward`: a reward model, the policy's architecture with a scalar head in place of the LM
head (train.model.heads), trained on `format: preference` pairs with the Bradley-Terry loss
−log σ(r_chosen − r_rejected − margin) + center_coef·(r_chosen + r_rejected)² (TRL's RewardTrainer; the
`reward:` section). A sequence's reward is the head's value at its last token, as transformers'
`LlamaForSequenceClassification` scores the last non-padding token. In-loop evaluation reports the
held-out pairs' accuracy (with its standard error), loss and margin.

Export (`train ckpt export` of a reward-model checkpoint) writes a transformers sequence-classification
folder (`score.weight`, num_labels 1); train.objectives.rewards reads one (or a checkpoint) for RL's
`model` reward.
"""
from __future__ import annotations

import math

import torch

from train.model.docmask import micro_batch
from train.objectives.base import Objective
from train.objectives.dpo import DPO
from train.objectives.rl_losses import reward_model_loss

HEAD = "reward_head"
METRICS = ("accuracy", "margin", "rewards_chosen", "rewards_rejected")


def last_token_scores(scores: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Each row's score at its last real token ([B, S, 1] scores, segments -1 on padding)."""
    last = (segments >= 0).sum(1) - 1
    return scores[torch.arange(scores.shape[0], device=scores.device), last, 0]


class RewardModel(Objective):
    name = "reward"
    data = "pairs"
    report_fields = METRICS
    fresh_keys = (HEAD,)

    @classmethod
    def validate(cls, cfg) -> None:
        cfg.reward.validate()

    @classmethod
    def extend_model(cls, cfg, chunks: list) -> None:
        from train.model.heads import attach

        for c in chunks:
            attach(c, HEAD, seed=cfg.seed, replace=True)

    def rows_per_micro(self) -> int:
        return 2 * self.cfg.parallel.micro_batch_size

    def sequences(self, global_batch: int) -> int:
        return 2 * global_batch

    def before_step(self, batch: torch.Tensor) -> torch.Tensor:
        return DPO.trim(batch)

    def forward(self, model, rows, docs: dict, rope: dict):
        mb = micro_batch(rows[:, :4], **docs)
        rope["positions"] = mb.positions
        pos = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).expand_as(mb.tokens)
        out = model(mb.tokens, pos, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
        segments = rows[:, 3]
        return out, lambda scores: self.loss(last_token_scores(scores.float(), segments), mb.nonpad)

    def loss(self, r: torch.Tensor, nonpad: torch.Tensor):
        rc = self.cfg.reward
        chosen, rejected = r[0::2], r[1::2]
        margin = torch.full_like(chosen, rc.margin) if rc.margin else None
        losses = reward_model_loss(chosen, rejected, margin, rc.center_coef)
        total = losses.sum()
        n = torch.tensor(len(losses), dtype=torch.int, device=total.device)
        with torch.no_grad():
            m = [(chosen > rejected).double().sum(), (chosen - rejected).double().sum(), chosen.double().sum(),
                 rejected.double().sum()]
        return total, n, torch.stack([total.detach().double(), n.double(), nonpad.double(), *m])

    def record(self, report) -> dict:
        n = float(report[1])
        return {k: float(report[3 + i]) / n for i, k in enumerate(METRICS)} if n else {}

    def log_fields(self, window: list[dict], tokens: int, elapsed: float) -> dict:
        return {"pairs": window[-1]["loss_tokens"],
                **{k: sum(w[k] for w in window if k in w) / len(window) for k in METRICS if k in window[-1]}}

    def evaluate(self) -> dict:
        """Accuracy (and its standard error), loss and margin on the held-out pairs, the model as it is now."""
        import torch.distributed as dist

        from storage.loader.pairs import iter_pairs
        from storage.manifest import read_manifest

        held = read_manifest(self.cfg.data.dataset).validation
        names = [name for name, src in held.items() if src.kind == "preference"]
        if not names:
            return {}
        per = {name: list(iter_pairs(self.cfg.data.dataset, "validation", source=name)) for name in names}
        r = torch.tensor(score_pairs(self.model, self.par, [p for ps in per.values() for p in ps],
                                     self.cfg.data.seq_len), dtype=torch.float64)
        chosen, rejected = r[0::2], r[1::2]
        out = _accuracy("reward_val/", chosen, rejected)
        out["reward_val/loss"] = float(reward_model_loss(chosen, rejected).mean())
        if len(names) > 1:  # and per source: a preference can be learnable in one source and not another
            start = 0
            for name, ps in per.items():
                out |= _accuracy(f"reward_val/{name}/", chosen[start:start + len(ps)], rejected[start:start + len(ps)])
                start += len(ps)
        box = [out]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _accuracy(prefix: str, chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """Pair accuracy, its standard error, mean margin and count, keys under `prefix`."""
    acc, n = float((chosen > rejected).double().mean()) if len(chosen) else 0.0, len(chosen)
    return {f"{prefix}accuracy": acc, f"{prefix}accuracy_se": math.sqrt(acc * (1 - acc) / max(n, 1)),
            f"{prefix}margin": float((chosen - rejected).mean()) if n else 0.0, f"{prefix}pairs": n}


def score_pairs(chunks: list, par, pairs: list, seq_len: int) -> list[float]:
    """The model's scores of every side (chosen, rejected, ...) of `pairs` (iter_pairs tuples), on every rank:
    a forward-only pipeline pass over this DP rank's share, then an all-gather over DP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    sides = [t for _, _, ct, _, rt, _ in pairs for t in (ct, rt)]
    mine = list(range(par.dp_rank, len(sides), par.dp))
    out: dict[int, float] = {}
    for start in range(0, len(mine), 8):
        idx = mine[start:start + 8]
        width = max(len(sides[i]) for i in idx)
        tokens = torch.zeros(len(idx), width, dtype=torch.long)
        segments = torch.full((len(idx), width), -1, dtype=torch.long)
        for j, i in enumerate(idx):
            tokens[j, :len(sides[i])] = torch.as_tensor(sides[i])
            segments[j, :len(sides[i])] = 0
        tokens, segments = tokens.to(par.device), segments.to(par.device)

        def forward_step(data_iterator, model, tokens=tokens, segments=segments):
            next(data_iterator)
            o = model(tokens, torch.arange(width, device=tokens.device).expand_as(tokens), None)
            return o, lambda s: (s.sum(), torch.tensor(1, dtype=torch.int, device=s.device),
                                 {"r": last_token_scores(s.float(), segments).detach()})

        with torch.no_grad():
            stores = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]),
                                                 model=chunks, num_microbatches=1, seq_length=width,
                                                 micro_batch_size=len(idx), forward_only=True)
        vals = stores[0]["r"].tolist() if par.is_last_stage else [0.0] * len(idx)
        out.update(zip(idx, vals))
    # the last stage's TP rank 0 of each DP replica holds the truth: gather those over the whole world
    pieces = [None] * dist.get_world_size()
    keep = par.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
    dist.all_gather_object(pieces, out if keep else {})
    merged: dict[int, float] = {}
    for p in pieces:
        merged.update(p)
    return [merged[i] for i in range(len(sides))]
