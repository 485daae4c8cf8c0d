"""`AblationConfig`: the typed config of `train ablate` (train.ablate), validated with errors naming the key.

One training config, N dataset variants of one `datapipe build` config (each a set of dotted overrides),
K seeds each, equal training tokens, scored on the same held-out validation sets and early-signal tasks.
Paths are relative to the working directory, as in every other config of the project.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from storage.config import ConfigError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]*")  # a variant or validation name: a folder name and a label part
# the keys `train ablate` sets itself: per variant (the build's output) and per run
BUILD_KEYS = ("output", "work_dir")
RUN_KEYS = ("run_dir", "steps", "stop_at", "epochs", "seed", "data.seed", "data.dataset")


@dataclass
class AblationSlurm:
    """`train ablate --slurm`: one array task per (variant, seed) run. The sbatch settings (partition,
    account, time, gpus_per_node, cpus_per_task, requeue, env, setup, extra_sbatch) are the training
    config's `launch.slurm`."""
    max_parallel: int | None = None  # at most this many runs at once (sbatch --array=0-N%max_parallel); null: no cap
    report_time: str = "00:30:00"  # sbatch --time of the job that writes the report once the array has ended

    def validate(self) -> None:
        if self.max_parallel is not None and self.max_parallel < 1:
            raise ConfigError(f"key 'slurm.max_parallel': must be >= 1 or null, got {self.max_parallel}")


@dataclass
class AblationConfig:
    """`train ablate ABLATION.yaml`: dataset variants × seeds, equal tokens, one verdict per variant."""
    build: str  # the `datapipe build` config every variant is built from (YAML)
    train: str  # the `train launch` config of every run (YAML); run_dir, data.dataset, seed, data.seed and steps are set per run
    tokens: int  # training tokens of every run: steps = tokens // (parallel.global_batch_size × data.seq_len)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # name → dotted overrides of the build config, as --set takes them ({}: the config as is)
    output: str = "runs/ablation"  # datasets, runs, results, report and plots go here
    baseline: str = ""  # the variant every other is compared with ("": the first)
    train_overrides: dict[str, Any] = field(default_factory=dict)  # dotted overrides of the train config, for every run
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])  # one run per variant and seed (sets seed and data.seed)
    validation: dict[str, str] = field(default_factory=dict)  # name → a build config (built with the shared tokenizer) or a built dataset folder: every run is scored on its held-out split
    validation_tokens: int = 65536  # held-out target tokens scored per source of each validation set
    tasks: list[str] = field(default_factory=list)  # early-signal tasks (`train eval --tasks`), scored once per run
    limit: int | None = 200  # items per task (`train eval --limit`); null: every item
    metrics: list[str] = field(default_factory=list)  # result keys that get rows and verdicts, e.g. val/pydoc/bpb; []: every validation loss and bpb, every task metric
    nproc: int | None = None  # processes per training run (train launch --nproc; null: launch.nproc, the GPUs, or 1) and per evaluation (null: 1)
    slurm: AblationSlurm = field(default_factory=AblationSlurm)  # with --slurm: the array's cap, the report job (sbatch settings: the train config's launch.slurm)

    def validate(self) -> None:
        for key in ("build", "train"):
            path = getattr(self, key)
            if not os.path.isfile(path):
                raise ConfigError(f"key '{key}': config file {path!r} not found")
        if self.tokens < 1:
            raise ConfigError(f"key 'tokens': must be >= 1, got {self.tokens}")
        if len(self.variants) < 2:
            raise ConfigError(f"key 'variants': an ablation compares at least two variants, got {len(self.variants)}")
        for name, sets in self.variants.items():
            if not NAME.fullmatch(name):
                raise ConfigError(f"key 'variants.{name}': a name of letters, digits, _ + - (it names a folder)")
            for k in sets:
                if not k or k.strip(".") != k:
                    raise ConfigError(f"key 'variants.{name}': {k!r} is not a dotted key")
                if k.split(".")[0] in BUILD_KEYS:
                    raise ConfigError(f"key 'variants.{name}.{k}': set by train ablate (OUTPUT/data/{name})")
        if self.baseline and self.baseline not in self.variants:
            raise ConfigError(f"key 'baseline': {self.baseline!r} is not a variant ({', '.join(self.variants)})")
        for k in self.train_overrides:
            if k in RUN_KEYS or k.split(".")[0] in ("run_dir", "steps", "stop_at", "epochs", "seed"):
                raise ConfigError(f"key 'train_overrides.{k}': set by train ablate for every run")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ConfigError(f"key 'seeds': distinct integers >= 0, at least one, got {self.seeds}")
        for name, path in self.validation.items():
            if not NAME.fullmatch(name):
                raise ConfigError(f"key 'validation.{name}': a name of letters, digits, _ + - (it names a folder)")
            if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, "manifest.json"))):
                raise ConfigError(f"key 'validation.{name}': {path!r} is neither a build config file nor a built "
                                  "dataset folder (with manifest.json)")
        if not self.validation and not self.tasks:
            raise ConfigError("key 'validation': give at least one validation set (or a task): runs need a score")
        if self.validation_tokens < 1:
            raise ConfigError(f"key 'validation_tokens': must be >= 1, got {self.validation_tokens}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"key 'limit': must be >= 1 or null, got {self.limit}")
        for i, t in enumerate(self.tasks):
            if not t.strip() or "," in t:
                raise ConfigError(f"key 'tasks.{i}': {t!r} is not a task spec")
        for i, m in enumerate(self.metrics):
            if not m.strip():
                raise ConfigError(f"key 'metrics.{i}': empty metric name")
        if self.nproc is not None and self.nproc < 1:
            raise ConfigError(f"key 'nproc': must be >= 1 or null, got {self.nproc}")

    @property
    def baseline_name(self) -> str:
        return self.baseline or next(iter(self.variants))
