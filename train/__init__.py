"""smoltrain train: a Megatron-core GPT trainer (TP × PP × DP) with monitoring, alerts and checkpoints.

Entry point: the `train` command (`train.cli`: launch, estimate, plot; `ckpt` from train.checkpoint).
- `config`: `TrainConfig`, validated before any process starts (errors name the key).
- `models`: presets (tiny, SmolLM2 135m/360m/1.7b, SmolLM3 3b) → TransformerConfig → GPTModel.
- `parallel`: process groups, Megatron-style seeds per TP/PP rank, DDP wrapping.
- `optim`: megatron AdamW (plain or distributed), cosine / WSD schedules, clipping, spike detection.
- `data`: storage's streaming loader (or synthetic tokens) per DP rank.
- `metrics`: FLOPs/token, MFU, memory, console/JSONL/TensorBoard sinks, alerts.
- `trainer`: the `Trainer` (state in `trainer.state`, a `train.state.TrainState`); `run`: torchrun entry.
- `launch`: torchrun (single node, c10d multi-node) and Slurm sbatch; `estimate`; `plot`.
- `cpu_compat`: lets megatron-core run under gloo without CUDA (tests); a no-op with CUDA.
See docs/train.md.
"""
