"""Knowledge distillation on the trainer: `objective: distill` (a pretraining token stream) and
`objective: distill_sft` (packed conversations, loss on the assistant tokens, document masking), the
`distill:` section (distill_config.py).

The teacher is a frozen model built from its own checkpoint's model config (another width or depth is
fine) under the run's TP × PP layout; it must have the student's vocabulary (refused with both sizes
otherwise) and embedding padding. Each step, before the student's forward/backward, it scores this rank's
rows micro-batch by micro-batch with a forward-only pipeline schedule (the same document masking and RoPE
positions as the student); its logits (or only its top-k logits and ids, with `top_k`: k / vocabulary of
the memory) wait on the last pipeline stage for the student's loss.

Token loss = (1 − ce_weight)·divergence(teacher, student) + ce_weight·cross entropy (distill_loss.py; the
divergence is TRL's generalized JSD, TP-aware); the micro-batch returns the sum over its loss tokens and
megatron divides the gradients by the step's global count of loss tokens (per_token_loss), as SFT does.
"""
from __future__ import annotations


import torch

from train.model.docmask import micro_batch
from train.objectives import distill_loss as DL
from train.objectives.base import Objective
from train.objectives.lm import model_inputs
from train.objectives.teacher import Teacher, document_settings, keep_fn, resolve_teacher

METRICS = ("kd", "ce")


class Distill(Objective):
    name = "distill"
    data = "tokens"
    per_token_loss = True
    report_fields = METRICS

    @classmethod
    def validate(cls, cfg) -> None:
        cfg.distill.check()

    @classmethod
    def check_data(cls, cfg) -> None:
        resolve_teacher(cfg)

    def __init__(self, cfg, par, model: list, sinks):
        super().__init__(cfg, par, model, sinks)
        d = cfg.distill
        self.beta, self.vocab = DL.beta_of(d.loss, d.beta), cfg.model.resolved().vocab_size
        # precomputed: the teacher is built only for the pass that fills a missing cache (prepare)
        self.teacher = None if d.precomputed else Teacher(cfg, par, d.teacher)
        self.cache = None
        self.outs: list = []
        self.micro = 0
        self.docs = document_settings(cfg, self.data, model)

    @classmethod
    def needs_pass(cls, cfg) -> bool:
        from train.objectives import teacher_cache as TC

        return bool(cfg.distill.precomputed) and not TC.complete(cfg)

    @classmethod
    def run_pass(cls, cfg, par, loader, batches) -> None:
        """The teacher alone over the run's rows: its top-k into the cache (train.objectives.teacher_cache)."""
        from train.objectives import teacher_cache as TC

        resolve_teacher(cfg)
        TC.compute(cfg, par, Teacher(cfg, par, cfg.distill.teacher), cls.data, loader, batches,
                   log=(lambda m: print(m, flush=True)) if par.rank == 0 else (lambda m: None))

    def prepare(self, step: int) -> None:
        if self.cfg.distill.precomputed and self.par.is_last_stage:
            from train.objectives import teacher_cache as TC

            self.cache = TC.TeacherCache(TC.cache_dir(self.cfg, self.cfg.distill.teacher), self.par.device)

    def before_step(self, batch):
        """The teacher's outputs for each micro-batch of this rank's rows (last stage), before the student's:
        from the teacher, or looked up in the precomputed cache."""
        micro = list(batch.to(self.par.device).split(self.rows_per_micro()))
        if self.cfg.distill.precomputed:
            self.outs = self.cache.outputs(micro, self.docs["varlen"]) if self.cache else []
        else:
            self.outs = self.teacher.outputs(micro, self.docs, keep_fn(self.cfg, self.vocab)) or []
        self.micro = 0
        return batch

    def forward(self, model, rows, docs: dict, rope: dict):
        mb = micro_batch(rows, **docs)
        rope["positions"] = mb.positions
        tokens, positions = model_inputs(mb)
        out = model(tokens, positions, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
        i, self.micro = self.micro, self.micro + 1
        return out, lambda logits: self.loss(logits, mb, self.outs[i] if i < len(self.outs) else None)

    def loss(self, logits: torch.Tensor, mb, teacher):
        d = self.cfg.distill
        if isinstance(teacher, tuple):
            kd = DL.top_k(logits, *teacher, beta=self.beta, temperature=d.temperature)
        else:
            kd = DL.full_vocab(logits, teacher, beta=self.beta, temperature=d.temperature, vocab=self.vocab)
        ce = DL.ce_tp(logits, mb.labels.reshape(logits.shape[:-1]))
        mask = torch.ones_like(kd) if mb.loss_mask is None else mb.loss_mask.reshape(kd.shape).float()
        tok = (1.0 - d.ce_weight) * kd + d.ce_weight * ce
        total = (tok * mask).sum()
        n = mask.sum()
        report = torch.stack([total.detach().double(), n.double(), mb.nonpad.double(),
                              (kd.detach() * mask).sum().double(), (ce.detach() * mask).sum().double()])
        return total, n.to(torch.int), report

    def record(self, report) -> dict:
        n = float(report[1])
        return {k: float(report[3 + i]) / n for i, k in enumerate(METRICS)} if n else {}

    def log_fields(self, window: list[dict], tokens: int, elapsed: float) -> dict:
        return {k: sum(w[k] for w in window) / len(window) for k in METRICS if k in window[-1]}


class DistillSFT(Distill):
    name = "distill_sft"
    data = "conversations"
    document_masking = True

    def log_fields(self, window: list[dict], tokens: int, elapsed: float) -> dict:
        nonpad = sum(w["nonpad_tokens"] for w in window)
        return super().log_fields(window, tokens, elapsed) | {
            "nonpad_tokens_per_s": nonpad / elapsed if elapsed > 0 else 0.0, "packing_efficiency": nonpad / tokens}
