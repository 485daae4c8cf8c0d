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

import os

import torch

from storage.config import ConfigError
from train.model.docmask import micro_batch
from train.objectives import distill_loss as DL
from train.objectives.base import Objective
from train.objectives.lm import model_inputs

METRICS = ("kd", "ce")


def teacher_model_config(ckpt: str):
    """The teacher's ModelConfig, from its checkpoint manifest's meta.model."""
    import fsspec

    from train.checkpoint import layout
    from train.model.gpt import ModelConfig

    meta = layout.read_manifest(fsspec.filesystem("file"), ckpt).get("meta") or {}
    if "model" not in meta:
        raise ConfigError(f"key 'distill.teacher': {ckpt}: its manifest records no model config (meta.model)")
    known = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(**{k: v for k, v in meta["model"].items() if k in known})


def resolve_teacher(cfg) -> str:
    """distill.teacher → a verified checkpoint step folder (a HF folder is imported once into
    RUN_DIR/teacher); checks vocabulary, padding and the layout. Sets cfg.distill.teacher."""
    from train.checkpoint.init_from import find_checkpoint
    from train.generation.load import is_hf_folder

    path = cfg.distill.teacher
    if is_hf_folder(path):
        from train.checkpoint.import_hf import import_folder

        root = os.path.join(cfg.run_dir, "teacher")
        if not (os.path.isdir(root) and any(n.startswith("step_") for n in os.listdir(root))):
            import_folder(path, root)
        path = root
    ckpt = find_checkpoint(path, "key 'distill.teacher'")
    t = teacher_model_config(ckpt).resolved()
    student_vocab = cfg.model.resolved().vocab_size if cfg.model.vocab_size is not None else None
    if student_vocab is None and cfg.data.dataset and not cfg.debug.synthetic_data:
        from storage.manifest import read_manifest

        student_vocab = read_manifest(cfg.data.dataset).tokenizer.vocab_size
    if student_vocab is not None and t.vocab_size != student_vocab:
        raise ConfigError(f"key 'distill.teacher': the teacher {ckpt} has a vocabulary of {t.vocab_size} tokens, the "
                          f"student {student_vocab}: distillation compares distributions over the same vocabulary")
    p = cfg.parallel
    if t.num_heads % p.tp or t.num_kv_heads % p.tp or t.num_layers % p.pp:
        raise ConfigError(f"key 'distill.teacher': the teacher ({t.num_heads} heads, {t.num_kv_heads} KV heads, "
                          f"{t.num_layers} layers) does not split over parallel.tp {p.tp} × parallel.pp {p.pp}")
    import dataclasses

    mine = dataclasses.replace(cfg.model, vocab_size=t.vocab_size).padded_vocab_size(p.tp)
    theirs = teacher_model_config(ckpt).padded_vocab_size(p.tp)
    if mine != theirs:
        raise ConfigError(f"key 'model.make_vocab_size_divisible_by': the student's embedding has {mine} rows at "
                          f"tp={p.tp}, the teacher's {theirs}: set it to the teacher's "
                          f"({teacher_model_config(ckpt).make_vocab_size_divisible_by}) so the vocabulary slices align")
    cfg.distill.teacher = ckpt
    return ckpt


class Teacher:
    """The frozen teacher under the training layout: `outputs(batch, ...)` runs this rank's rows through a
    forward-only pipeline schedule and returns, on the last stage, one output per micro-batch."""

    def __init__(self, cfg, par, ckpt: str):
        from train.checkpoint.init_from import load_weights
        from train.model.gpt import build_model

        self.model_cfg = teacher_model_config(ckpt)
        self.chunks = build_model(self.model_cfg, tp=par.tp, pp=par.pp, bf16=cfg.bf16_weights(), seed=cfg.seed)
        if torch.cuda.is_available():
            for c in self.chunks:
                c.cuda(torch.cuda.current_device())
        load_weights(self.chunks, None, ckpt)
        for c in self.chunks:
            c.eval()
            c.requires_grad_(False)
        self.par = par

    def outputs(self, micro: list, docs: dict, keep) -> list | None:
        """keep(logits) → what to hold per micro-batch of rows (the logits, or their top-k)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from train.model.docmask import rope_positions

        mbs = len(micro[0])
        seq = micro[0].shape[-1] - (1 if micro[0].dim() == 2 else 0)
        seq_length, micro_batch_size = (seq * mbs, 1) if docs["varlen"] else (seq, mbs)

        def forward_step(data_iterator, model):
            mb = micro_batch(next(data_iterator), **docs)
            box["positions"] = mb.positions
            tokens, positions = model_inputs(mb)
            out = model(tokens, positions, mb.attention_mask, packed_seq_params=mb.packed_seq_params)

            def collect(logits):
                return logits.sum() * 0, torch.tensor(1, dtype=torch.int, device=logits.device), {"out": keep(logits)}
            return out, collect

        with torch.no_grad(), rope_positions(self.chunks) as box:
            stores = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=self.chunks,
                num_microbatches=len(micro), seq_length=seq_length, micro_batch_size=micro_batch_size,
                forward_only=True)
        return [s["out"] for s in stores] if self.par.is_last_stage else None


def keep_fn(cfg, vocab: int):
    """What the student's loss needs of the teacher's logits: all of them, or the top-k (values, ids)."""
    k = cfg.distill.top_k
    return (lambda logits: DL.teacher_top_k(logits, k, vocab)) if k else (lambda logits: logits)


def document_settings(cfg, data: str, chunks: list) -> dict:
    """micro_batch's settings as the trainer's (train.trainer._document_settings) for the same run."""
    from train.eval.scorer import supports_trees

    eos = None
    if cfg.document_masking() and data == "tokens":
        from storage.manifest import read_manifest

        eos = read_manifest(cfg.data.dataset).tokenizer.eos_id
    return {"document_masking": cfg.document_masking(), "eos_id": eos,
            "varlen": cfg.document_masking() and not supports_trees(chunks)}


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

    def prepare(self, step: int) -> None:
        if not self.cfg.distill.precomputed:
            return
        from train.objectives import teacher_cache as TC

        folder = TC.cache_dir(self.cfg, self.cfg.distill.teacher)
        if not os.path.isfile(os.path.join(folder, "cache.json")):
            if step != 0:
                raise TC.TeacherCacheError(f"{folder}: no teacher cache and the run is past step 0; run "
                                           "`train teacher-cache` with this config")
            if self.sinks:
                self.sinks.event(0, "teacher", f"computing the teacher's top-{self.cfg.distill.top_k} logits into {folder}")
            teacher = Teacher(self.cfg, self.par, self.cfg.distill.teacher)
            TC.compute(self.cfg, self.par, teacher, self.data, log=lambda m: None)
            del teacher
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self.par.is_last_stage:
            self.cache = TC.TeacherCache(folder, self.par.device)

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
