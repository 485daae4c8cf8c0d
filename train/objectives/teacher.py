"""The frozen teacher of distillation (train.objectives.distill, and the pass that fills the teacher cache,
train.objectives.teacher_cache): its checkpoint resolved and checked against the student (vocabulary,
padding, layout), the model built under the run's TP × PP layout, and its outputs for rows of the run.
"""
from __future__ import annotations

import os

import torch

from storage.config import ConfigError
from train.model.docmask import micro_batch
from train.objectives import distill_loss as DL
from train.objectives.lm import model_inputs


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
        from train.checkpoint.init_from import frozen_model

        self.model_cfg = teacher_model_config(ckpt)
        self.chunks = frozen_model(self.model_cfg, cfg, par, ckpt)
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
