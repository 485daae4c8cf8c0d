"""`objective: ppo`: the RL loop of rl.py with a critic. A value head on the policy's trunk (train.model.heads,
TRL's former `AutoModelForCausalLMWithValueHead` layout) predicts, at every completion position, the return
of the tokens that follow. Before the update, a forward-only pass of the current model gives the old
log-probs and values; per-token rewards are −kl_coef·(logπ_old − logπ_ref) (k1, as PPO's reward shaping
does) plus the sequence's reward on its last token; GAE (rl.gamma, rl.lam) gives per-token advantages
(whitened over the step's completion tokens) and returns. The loss is the clipped policy loss plus
rl.value_coef × the clipped value loss 0.5·max((V − R)², (V_old + clip(V − V_old, ±value_clip) − R)²),
both token means over the step (rl_losses.py).
"""
from __future__ import annotations

import torch

from train.objectives import rl_losses as L
from train.objectives.rl import RL, token_logps
from train.objectives.rollout import F

HEAD = "value_head"


def _box(model) -> dict:
    from megatron.core.utils import unwrap_model

    return unwrap_model([model])[0].scalar_box


class PPO(RL):
    name = "ppo"
    estimator = "ppo"
    fresh_keys = (HEAD,)

    @classmethod
    def extend_model(cls, cfg, chunks: list) -> None:
        from train.model.heads import attach

        super().extend_model(cfg, chunks)  # logits at the completion positions; the value head reads them all
        for c in chunks:
            c.scalar_box = {}
            attach(c, HEAD, seed=cfg.seed, replace=False, box=c.scalar_box)

    def before_step(self, prompts: list) -> torch.Tensor:
        rows = super().before_step(prompts)
        old = self._old_pass(rows)
        if old is None:  # not the last pipeline stage: the loss is computed elsewhere
            return rows
        logp, values = old
        rl, mask = self.rl, rows[:, F["mask"]]
        rewards = torch.zeros_like(logp)
        if rl.kl_coef:
            rewards = rewards - rl.kl_coef * (logp - rows[:, F["ref_logp"]]) * mask
        last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)  # each completion's last token
        rewards = rewards + last * rows[:, F["advantage"], :1]  # the sequence reward rollout.py put there
        adv, ret = L.gae(rewards, values, mask, rl.gamma, rl.lam)
        adv = self._whiten(adv, mask)
        rows[:, F["advantage"]] = adv
        rows[:, F["returns"]] = ret
        rows[:, F["old_values"]] = values * mask
        return rows

    def _whiten(self, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Advantages whitened over the step's completion tokens on every DP rank (sums all-reduced)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        s = torch.stack([(adv * mask).sum(), (adv * adv * mask).sum(), mask.sum()]).double()
        dist.all_reduce(s, group=ps.get_data_parallel_group())
        mean = s[0] / s[2].clamp(min=1)
        var = (s[1] / s[2].clamp(min=1) - mean * mean) * s[2] / (s[2] - 1).clamp(min=1)
        return (adv - mean) / (var.sqrt() + 1e-8) * mask

    def _old_pass(self, rows: torch.Tensor):
        """(log-probs, values) [rows, width] of the current model, forward only (last stage; else None)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro = list(rows.split(self.rows_per_micro()))

        def forward_step(data_iterator, model):
            r = next(data_iterator)
            out = self.policy_forward(model, r)

            def collect(logits):
                lp, _ = token_logps(logits, r[:, F["labels"]].long(), r[:, F["mask"]], self.vocab,
                                    self.rl.temperature, entropy_grad=False)
                v = _box(model)["values"]
                return lp.sum(), torch.tensor(1, dtype=torch.int, device=lp.device), {"lp": lp.detach(),
                                                                                      "v": v.detach()}
            return out, collect

        with torch.no_grad():
            stores = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=self.model,
                num_microbatches=len(micro), seq_length=rows.shape[-1], micro_batch_size=self.rows_per_micro(),
                forward_only=True)
        if not self.par.is_last_stage:
            return None
        return torch.cat([s["lp"] for s in stores]).double(), torch.cat([s["v"] for s in stores]).double()

    def forward(self, model, rows, docs: dict, rope: dict):
        out, _ = super().forward(model, rows, docs, rope)
        box = _box(model)
        return out, lambda logits: self.ppo_loss(logits, box["values"], rows)

    def ppo_loss(self, logits: torch.Tensor, values: torch.Tensor, rows: torch.Tensor):
        total, n, report = self.loss(logits, rows, kl_in_loss=False)
        mask = rows[:, F["mask"]].float()
        vl = L.value_loss(values, rows[:, F["old_values"]].float(), rows[:, F["returns"]].float(), self.rl.value_clip)
        w = rows[:, F["weight"]].float()
        total = total + self.rl.value_coef * self.tokens * (w * vl).sum()
        report = report.clone()
        report[0] = total.detach().double()
        report[-1] = (vl.detach() * mask).sum().double()
        return total, n, report

    def record(self, report) -> dict:
        out = super().record(report)
        n = float(report[1])
        if n:
            out["value_loss"] = float(report[-1]) / n
        return out
