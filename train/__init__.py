"""smoltrain train: a Megatron-core GPT trainer (TP × PP × DP) with monitoring, alerts, checkpoints,
evaluation and post-training objectives.

Entry point: the `train` command (`cli`: launch, eval, generate, refs, estimate, plot; `ckpt` from
train.checkpoint). The top level holds the run itself: `config` (`TrainConfig`, validated before any
process starts), `launch` (torchrun, multi-node, Slurm), `run` (the torchrun worker), `trainer` (the
generic `Trainer`, which names no objective), `optim` (AdamW, schedules, clipping, spike detection),
`rampup` (batch-size ramp-up), `state` (`TrainState`, what a checkpoint saves), `data` (the loader an
objective reads, per DP rank), `ablate` (data ablations: `train ablate`, with `ablate_config`, `ablate_jobs`,
`ablate_report`). Each concern below it is a package, lowest layer first:

- `model`: presets → megatron GPTModel, precision, parallel groups and seeds, document masking, CPU shim;
- `monitor`: metrics, MFU, communication share, console and logs, plots, the estimator;
- `checkpoint`: async, incremental, atomic checkpoints, resume, offload, HF export/import, merges;
- `generation`: text generation from a checkpoint or a HF folder;
- `eval`: validation loss and benchmarks, in the loop and on checkpoints;
- `objectives`: the `Objective` interface and registry; pretrain, sft, dpo.
A module imports only storage, its own package and the layers before it; `train.state` and
`train.config` may be imported from anywhere. tests/train/test_train_layout.py checks it, and that no
import circle exists. See docs/architecture.md and docs/train.md.
"""
