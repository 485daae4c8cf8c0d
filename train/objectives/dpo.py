"""objective dpo: reference log-probs for each step's pairs, the pair loss, its metrics, and
the same metrics on the held-out pairs.

Batches come from storage.loader.pairs (rows chosen, rejected, chosen, ... with the pair's ordinal in
field 4); chosen and rejected go through one forward pass, and each micro-batch's loss is the sum of its
pairs' losses (train.objectives.preference): megatron's per-token normalisation divides the gradients by the step's
global pair count. References are the precomputed table (train.objectives.refs, computed at the first start when
missing) or, with `dpo.reference: online`, a frozen copy scoring each step's pairs first.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from storage.config import ConfigError
from train.model.docmask import micro_batch
from train.objectives.base import Objective
from train.objectives.lm import model_inputs
from train.objectives.preference import METRICS, pair_losses, sequence_logps


class DPO(Objective):
    name = "dpo"
    data = "pairs"
    report_fields = METRICS

    @classmethod
    def validate(cls, cfg) -> None:
        cfg.dpo.validate()

    @classmethod
    def check_data(cls, cfg) -> None:
        if not (cfg.init or cfg.dpo.reference_checkpoint):
            raise ConfigError("key 'dpo.reference_checkpoint': objective dpo needs a reference model: set it, "
                              "or start from one with --init (init:), which is then the reference")

    def __init__(self, cfg, par, model: list, sinks):
        super().__init__(cfg, par, model, sinks)
        self.ref_ckpt = cfg.dpo.reference_checkpoint or cfg.init
        self.table: torch.Tensor | None = None   # [pairs, 2] float64: reference log-probs by pair ordinal
        self.val_refs: np.ndarray | None = None
        self.online = None

    def rows_per_micro(self) -> int:
        return 2 * self.cfg.parallel.micro_batch_size

    def prepare(self, step: int) -> None:
        """Reference log-probs for the training (and held-out) pairs: loaded, or computed now with the model
        as it is at step 0 (it holds the reference's weights when the reference is the --init checkpoint;
        another reference is loaded for the pass and the --init weights put back)."""
        from train.objectives import refs

        cfg = self.cfg
        if cfg.dpo.reference == "online":
            self.online = refs.OnlineReference(cfg, self.par, self.ref_ckpt)
            self.table = torch.zeros(0, 2, dtype=torch.float64, device=self.par.device)
        splits = ["train"] + (["validation"] if self._has_validation() else [])
        have = {s: refs.load(cfg.data.dataset, self.ref_ckpt, s) for s in splits}
        missing = [s for s in splits if have[s] is None and not (s == "train" and self.online)]
        if missing:
            if step != 0:
                raise refs.ReferenceError(
                    f"no reference log-probs for {cfg.data.dataset} under {self.ref_ckpt} ({', '.join(missing)}) "
                    "and the run is past step 0; run `train refs` for them")
            self._compute(missing, have)
        if self.online is None:
            self.table = torch.as_tensor(have["train"], device=self.par.device)
        self.val_refs = have.get("validation")

    def _compute(self, splits: list[str], have: dict) -> None:
        from train.objectives import refs
        from train.checkpoint.init_from import load_weights

        other = self.ref_ckpt != self.cfg.init
        if other:
            load_weights(self.model, None, self.ref_ckpt)
        for s in splits:
            self.sinks.event(0, "refs", f"computing reference log-probs of the {s} pairs under {self.ref_ckpt}")
            have[s] = refs.compute(self.model, self.par, self.cfg.data.dataset, self.ref_ckpt, s,
                                   log=lambda m: None)
        if other:
            load_weights(self.model, None, self.cfg.init)

    def _has_validation(self) -> bool:
        from storage.manifest import read_manifest

        return bool(read_manifest(self.cfg.data.dataset).validation)

    @staticmethod
    def trim(batch: torch.Tensor) -> torch.Tensor:
        """The batch cut after its longest sequence (rounded up to a multiple of 8): rows hold one side each,
        padded to seq_len, and trailing padding changes nothing under causal attention but costs compute."""
        longest = int((batch[:, 3] >= 0).sum(dim=1).max())
        return batch[..., :min(batch.shape[-1], -(-longest // 8) * 8)].contiguous()

    def before_step(self, batch: torch.Tensor) -> torch.Tensor:
        """The batch trimmed; with an online reference, this rank's pairs scored by the frozen copy first
        (they go into the table)."""
        batch = self.trim(batch)
        if self.online is None:
            return batch
        lp = self.online.logps(batch, self.rows_per_micro())
        if lp is None:
            return batch
        ids = batch[0::2, 4, 0].to(self.par.device)
        need = int(ids.max()) + 1
        if len(self.table) < need:
            grown = torch.zeros(need, 2, dtype=torch.float64, device=self.par.device)
            grown[:len(self.table)] = self.table
            self.table = grown
        self.table[ids, 0] = lp[0::2].double()
        self.table[ids, 1] = lp[1::2].double()
        return batch

    def forward(self, model, rows, docs: dict, rope: dict):
        """Chosen and rejected rows through one forward pass (fields 0-3: tokens, labels, mask, segments;
        field 4 holds the pair's ordinal)."""
        mb = micro_batch(rows[:, :4], **docs)
        rope["positions"] = mb.positions
        tokens, positions = model_inputs(mb)
        out = model(tokens, positions, mb.attention_mask, labels=mb.labels, packed_seq_params=mb.packed_seq_params)
        pairs = rows[0::2, 4, 0]
        return out, lambda token_losses: self.loss(token_losses, mb.loss_mask, pairs, mb.nonpad)

    def sequences(self, global_batch: int) -> int:
        return 2 * global_batch  # a pair is two

    def loss(self, token_losses: torch.Tensor, loss_mask: torch.Tensor, pair_ids: torch.Tensor,
             nonpad: torch.Tensor):
        """(sum of the micro-batch's pair losses, pairs, report [loss, pairs, non-padding, *METRICS sums])."""
        lp, count = sequence_logps(token_losses.float(), loss_mask)
        ref = self.table[pair_ids]
        losses, metrics = pair_losses(self.cfg.dpo, lp[0::2].double(), lp[1::2].double(), ref[:, 0], ref[:, 1],
                                      count[0::2].double(), count[1::2].double())
        total = losses.sum().float()
        n = torch.tensor(len(losses), dtype=torch.int, device=total.device)
        report = torch.stack([total.detach().double(), n.double(), nonpad.double(),
                              *(metrics[k].sum() for k in METRICS)])
        return total, n, report

    def record(self, report: torch.Tensor) -> dict:
        n = float(report[1])
        out = {k: float(report[3 + i]) / n for i, k in enumerate(METRICS)} if n else {}
        if out:
            out["reward_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
        return out

    def log_fields(self, window: list[dict], tokens: int, elapsed: float) -> dict:
        nonpad = sum(w["nonpad_tokens"] for w in window)
        out = {"nonpad_tokens_per_s": nonpad / elapsed if elapsed > 0 else 0.0, "packing_efficiency": nonpad / tokens,
               "pairs": window[-1]["loss_tokens"],
               "row_width": sum(w["width"] for w in window) / len(window)}  # batches are cut after the longest
        return out | {k: window[-1][k] for k in ("rewards_chosen", "rewards_rejected", "reward_margin",
                                                 "reward_accuracy", "logps_chosen", "logps_rejected")
                      if k in window[-1]}

    def evaluate(self) -> dict:
        """The same metrics (and the loss) on the held-out pairs, with the model as it is now."""
        if self.val_refs is None:
            return {}
        from storage.loader.pairs import iter_pairs
        from train.eval.scorer import Scorer
        from train.objectives.refs import _rows

        pairs = list(iter_pairs(self.cfg.data.dataset, "validation"))
        scores = Scorer(self.model, self.par).score(_rows(pairs))
        lp = torch.tensor([math.fsum(s) for s in scores], dtype=torch.float64).reshape(-1, 2)
        counts = torch.tensor([[int(np.asarray(cm)[1:].sum()), int(np.asarray(rm)[1:].sum())]
                               for *_, cm, _, rm in pairs], dtype=torch.float64)
        ref = torch.as_tensor(self.val_refs)
        losses, metrics = pair_losses(self.cfg.dpo, lp[:, 0], lp[:, 1], ref[:, 0], ref[:, 1], counts[:, 0], counts[:, 1])
        out = {f"dpo_val/{k}": float(v.mean()) for k, v in metrics.items()}
        out["dpo_val/loss"] = float(losses.mean())
        out["dpo_val/reward_margin"] = out["dpo_val/rewards_chosen"] - out["dpo_val/rewards_rejected"]
        out["dpo_val/pairs"] = len(pairs)
        return out
