"""A training objective defined outside train/: label-smoothed next-token cross entropy (torch's
F.cross_entropy formula, smoothing 0.1), registered by importing this module (config key `imports`).
The plugin test trains with it; nothing in train/ knows its name."""
from __future__ import annotations

import torch.nn.functional as F

from storage.config import ConfigError
from train.model.docmask import micro_batch
from train.objectives import register
from train.objectives.lm import Pretrain, model_inputs, token_loss_report

SMOOTHING = 0.1


@register
class LabelSmoothedCE(Pretrain):
    name = "label_smoothed_ce"

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.parallel.tp != 1:  # the logits of one TP rank hold a slice of the vocabulary
            raise ConfigError("key 'parallel.tp': label_smoothed_ce needs the whole vocabulary on one rank (tp 1)")

    def forward(self, model, rows, docs: dict, rope: dict):
        mb = micro_batch(rows, **docs)
        rope["positions"] = mb.positions
        tokens, positions = model_inputs(mb)
        logits = model(tokens, positions, mb.attention_mask)  # no labels: [B, S, V] on the last stage

        def loss(out):
            losses = F.cross_entropy(out.float().flatten(0, 1), mb.labels.flatten(), reduction="none",
                                     label_smoothing=SMOOTHING).view(mb.labels.shape)
            return token_loss_report(losses, mb)
        return logits, loss
