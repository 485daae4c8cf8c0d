"""`eval:` of the training config (and of `train eval`): when to evaluate, on what, and how to batch it.

Kept free of torch and megatron imports, so validating a config stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from storage.config import ConfigError
from storage.evaltasks import Task, TaskError, load_task


@dataclass
class EvalConfig:
    every: int = 0                   # steps between in-loop evaluations (0: none); with > 0 also after the last step
    validation_tokens: int = 65536   # held-out target tokens per source (0: no validation loss)
    tasks: list[str] = field(default_factory=list)  # e.g. [hellaswag, arc_easy, mmlu, mine=path.jsonl]
    limit: int | None = 200          # items per task: a deterministic subsample (null: every item)
    batch_tokens: int = 8192         # tokens per scoring batch (rows × longest row)
    max_length: int | None = None    # longest model input; null: model.max_position_embeddings (as lm-eval)
    shared_context: bool = True      # an item's candidates share one encoding of their context (local spec)

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"key 'eval.every': must be >= 0, got {self.every}")
        if self.validation_tokens < 0:
            raise ConfigError(f"key 'eval.validation_tokens': must be >= 0, got {self.validation_tokens}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"key 'eval.limit': must be >= 1 or null, got {self.limit}")
        if self.batch_tokens < 1:
            raise ConfigError(f"key 'eval.batch_tokens': must be >= 1, got {self.batch_tokens}")

    def load_tasks(self) -> list[Task]:
        try:
            return [load_task(t, self.limit) for t in self.tasks]
        except TaskError as e:
            raise ConfigError(f"key 'eval.tasks': {e}") from None
