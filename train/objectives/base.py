"""The `Objective` interface: everything objective-specific that the generic `Trainer` asks for, and the
registry that finds an objective by its config name (`objective: NAME`).

The Trainer owns the loop (data → micro-batches → megatron's forward/backward schedule → optimizer →
metrics → checkpoints) and names no objective. An objective says which loader it reads (`data`), how
many loader rows make a micro-batch, what happens before each step (trim the batch, score it with a
reference, later: roll out, reward, fetch teacher logits), the forward and loss of one micro-batch, how
many sequences a step consumed, and the metrics it adds to the step log and to in-loop evaluation. Extra
models it owns (a frozen reference, a teacher, a value head) and their checkpoint state are its own.

Built-in objectives are found by name without importing them here (the module path is data); a plugin
registers itself with `@register` when its module is imported, e.g. through the config's `imports` list,
which every process imports before the config is validated.
"""
from __future__ import annotations

import importlib
from typing import ClassVar

from storage.config import ConfigError

BUILTIN = {
    "pretrain": "train.objectives.lm:Pretrain",
    "sft": "train.objectives.lm:SFT",
    "dpo": "train.objectives.dpo:DPO",
    "grpo": "train.objectives.rl:GRPO",
    "rloo": "train.objectives.rl:RLOO",
    "ppo": "train.objectives.ppo:PPO",
    "reward": "train.objectives.reward_model:RewardModel",
    "distill": "train.objectives.distill:Distill",
    "distill_sft": "train.objectives.distill:DistillSFT",
}
_REGISTERED: dict[str, type[Objective]] = {}

# Loaders (train.data): a token stream of pretraining windows [rows, seq_len + 1]; packed whole
# conversations [rows, 4, seq_len]; preference pairs [2·pairs, 5, seq_len] (chosen, rejected, ...); prompts
# (a list of storage.loader.prompts.Prompt per step, which the objective turns into rows).
DATA_KINDS = ("tokens", "conversations", "pairs", "prompts")


class Objective:
    """Base class; the defaults are those of plain next-token training on a token stream."""

    name: ClassVar[str] = ""
    data: ClassVar[str] = "tokens"              # the loader it reads (DATA_KINDS)
    # megatron's calculate_per_token_loss: micro-batch losses are sums and the gradients are divided by
    # the step's global count (of tokens or pairs); False: megatron averages per micro-batch
    per_token_loss: ClassVar[bool] = True
    document_masking: ClassVar[bool] = False    # the default of data.document_masking
    report_fields: ClassVar[tuple[str, ...]] = ()  # sums after (loss, count, non-padding) in each report
    fresh_keys: ClassVar[tuple[str, ...]] = ()  # parameters the objective adds (heads): an --init checkpoint may lack them

    # ---- config time: no process group, no model
    @classmethod
    def validate(cls, cfg) -> None:
        """Objective-specific config checks (errors name the key)."""

    @classmethod
    def check_data(cls, cfg) -> None:
        """Checks that read the dataset or other files, before any process starts."""

    @classmethod
    def needs_pass(cls, cfg) -> bool:
        """True when `run_pass` must run before training; `train launch` then runs it first, under torchrun
        on every rank, in processes that hold no student model."""
        return False

    @classmethod
    def run_pass(cls, cfg, par, loader, batches) -> None:
        """A pass over the rows the run will read (`loader`: a fresh train.data loader of this rank, `batches`:
        the run's batch sizes), before training: e.g. a teacher's outputs computed into a cache."""

    @classmethod
    def extend_model(cls, cfg, chunks: list) -> None:
        """Change the freshly built model before it is wrapped (add a head: train.model.heads)."""

    # ---- in every training process
    def __init__(self, cfg, par, model: list, sinks):
        self.cfg, self.par, self.model, self.sinks = cfg, par, model, sinks

    def rows_per_micro(self) -> int:
        """Loader rows in one micro-batch."""
        return self.cfg.parallel.micro_batch_size

    def prepare(self, step: int) -> None:
        """After resume or --init, before the first step: load or compute what the objective needs."""

    def before_step(self, batch):
        """This rank's rows of the step → the rows the micro-batches are cut from (may trim, score with a
        reference model, generate, ...)."""
        return batch

    def forward(self, model, rows, docs: dict, rope: dict) -> tuple:
        """Forward one micro-batch (already on the device) → (output tensor, loss function). The loss
        function takes the output (on the last pipeline stage) and returns (loss sum, count, report): a
        float64 vector of (loss sum, count, non-padding tokens, *report_fields sums). `docs` holds the
        document-masking settings (train.model.docmask.micro_batch's keywords), `rope` the per-token
        RoPE positions box (train.model.docmask.rope_positions)."""
        raise NotImplementedError

    def sequences(self, global_batch: int) -> int:
        """Sequences of seq_len a step of `global_batch` loader units consumed."""
        return global_batch

    def record(self, report) -> dict:
        """Per-step log fields from the step's summed report."""
        return {}

    def log_fields(self, window: list[dict], tokens: int, elapsed: float) -> dict:
        """Fields added to a log record, from the steps since the last one (`tokens`: their sequences ×
        seq_len, `elapsed`: their time)."""
        return {}

    def evaluate(self) -> dict:
        """Metrics added to each in-loop evaluation."""
        return {}

    def state_dict(self) -> dict:
        """JSON-serialisable state a checkpoint keeps for this objective (restored before `prepare`)."""
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def close(self) -> None:
        pass


def register(cls: type[Objective]) -> type[Objective]:
    """Class decorator: make `cls` available as `objective: cls.name`."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__}: an objective needs a `name`")
    if cls.data not in DATA_KINDS:
        raise ValueError(f"objective {cls.name!r}: data {cls.data!r} is not one of {', '.join(DATA_KINDS)}")
    _REGISTERED[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(set(BUILTIN) | set(_REGISTERED))


def get(name: str) -> type[Objective]:
    """The objective class registered under `name` (ConfigError naming the key when unknown)."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in BUILTIN:
        module, cls = BUILTIN[name].split(":")
        return register(getattr(importlib.import_module(module), cls))
    raise ConfigError(f"key 'objective': unknown objective {name!r}; known: {', '.join(names())} (a plugin "
                      "registers one with train.objectives.register, imported through the `imports` key)")


def import_plugins(modules: list[str], key: str = "imports") -> None:
    """Import the modules a config names (they register objectives, reward functions, ...)."""
    for i, m in enumerate(modules):
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise ConfigError(f"key '{key}.{i}': cannot import {m!r}: {e}") from None

