"""Evaluation of the model in memory: validation loss on the held-out split (loss, perplexity, bits per
byte, per source) and log-likelihood multiple-choice benchmarks, in the training loop (`eval.every`)
and on any checkpoint or Hugging Face folder (`train eval`).

Modules: config (the `eval:` section), requests (lm-eval-identical request encoding and metrics),
scorer (batched forward-only scoring under TP × PP × DP, shared-context trees), validation (held-out
sequences and their metrics), evaluator (both, built once, run many times), run (the `train eval`
worker under torchrun), results (per-checkpoint JSON and the table), hf (transformers backend),
lmeval (the lm-evaluation-harness reference runner used by tests and benchmarks).

May import: storage, train.model, train.monitor, train.checkpoint, train.generation, and train.state /
train.config (docs/architecture.md).
"""
