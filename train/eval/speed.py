"""What a model costs to serve: its weights' size on disk and its generation speed.

`generation_speed` times greedy generation (the engine's padded backend, one prompt at a time, no EOS
stop: every prompt gets exactly `new_tokens` tokens) of a few fixed English prompts after one warm-up call,
and returns generated tokens per second: the latency-bound rate a single user sees. It runs on the
transformers model in hand (a checkpoint's HF mirror, or a HF folder, quantized ones included), so the rows of
`train eval --table` compare on one engine. Size: a HF folder's weight files; a checkpoint's model
tensors at its precision (what its HF export holds).
"""
from __future__ import annotations

import time

PROMPTS = ("The history of the city", "def parse(text):", "In the morning the", "Question: What is the capital",
           "Once upon a time", "import numpy as np", "The results show that", "Dear friend,")


def generation_speed(model, tokenizer, prompts: int = 8, new_tokens: int = 64) -> float:
    """Greedy tokens/s at batch size 1 (see the module doc)."""
    from train.generation.engine import Engine, SamplingParams

    engine = Engine(model, tokenizer, [], backend="padded", max_batch_size=1)
    ids = [tokenizer(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)["input_ids"] for i in range(prompts)]
    engine.generate(ids[:1], SamplingParams(max_new_tokens=4))
    t0, n = time.perf_counter(), 0
    for p in ids:
        n += len(engine.generate([p], SamplingParams(max_new_tokens=new_tokens))[0][0].token_ids)
    return n / (time.perf_counter() - t0)


def checkpoint_bytes(manifest: dict) -> int:
    """Bytes of a checkpoint's model weights at its precision (embedding rows as stored, tied once)."""
    from train.model.gpt import ModelConfig, num_parameters

    meta = manifest.get("meta") or {}
    known = set(ModelConfig.__dataclass_fields__)
    cfg = ModelConfig(**{k: v for k, v in (meta.get("model") or {}).items() if k in known})
    n = num_parameters(cfg)
    rows = meta.get("padded_vocab_size") or cfg.resolved().vocab_size
    total = n["total"] + (rows - cfg.resolved().vocab_size) * cfg.resolved().hidden_size * (1 if cfg.tie_embeddings else 2)
    return total * (2 if meta.get("precision") == "bf16" else 4)
