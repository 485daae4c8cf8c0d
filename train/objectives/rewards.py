"""Reward functions for RL (`rl.rewards`): verifiable rewards, a user's Python function, or a reward model.

Each is a callable `(prompts, completions, answers) -> list[float]` on texts (the completion decoded
without special tokens, cut before a stop string); the RL objective sums them with their weights, then
clips the sum (`rl.reward_clip`).
- `math`: 1.0 when math-verify (the parser and verifier TRL's accuracy reward uses) finds the completion's
  answer equal to the reference answer (GSM8K-style: "18", "$\\frac{1}{2}$", ...), else 0.0;
- `exact_match`: 1.0 when the completion, stripped and lower-cased, without a final period, equals the
  answer likewise normalised;
- `format`: 1.0 when the completion matches the regular expression `pattern` (re.search);
- `model`: the scalar of a reward model (`objective: reward`, exported or a checkpoint) on prompt + completion;
- `MODULE:FUNCTION`: a user function with the same signature, imported by name.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable

from storage.config import ConfigError

BUILTIN = ("math", "exact_match", "format", "model")
NEED_ANSWER = ("math", "exact_match")


@dataclass
class RewardSpec:
    name: str = "math"               # math | exact_match | format | model | MODULE:FUNCTION
    weight: float = 1.0
    pattern: str | None = None       # format: the regular expression a completion must match
    model: str | None = None         # model: a reward-model checkpoint or HF sequence-classification folder

    def check(self, key: str) -> None:
        if self.name not in BUILTIN and ":" not in self.name:
            raise ConfigError(f"key '{key}.name': unknown reward {self.name!r}; known: {', '.join(BUILTIN)}, or "
                              "MODULE:FUNCTION for a function of your own")
        if self.name == "format":
            if not self.pattern:
                raise ConfigError(f"key '{key}.pattern': the format reward needs a regular expression")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ConfigError(f"key '{key}.pattern': not a regular expression ({e})") from None
        if self.name == "model" and not self.model:
            raise ConfigError(f"key '{key}.model': the model reward needs a reward-model checkpoint or HF folder")
        if ":" in self.name:
            resolve_function(self.name, key)


def resolve_function(spec: str, key: str) -> Callable:
    module, _, fn = spec.partition(":")
    try:
        f = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"key '{key}.name': cannot load reward function {spec!r} ({e})") from None
    if not callable(f):
        raise ConfigError(f"key '{key}.name': {spec!r} is not callable")
    return f


def math_reward(prompts, completions, answers) -> list[float]:
    from math_verify import parse, verify

    out = []
    for c, a in zip(completions, answers, strict=True):
        gold = parse(a if "$" in a or "\\" in a else f"${a}$")
        out.append(1.0 if gold and verify(gold, parse(c)) else 0.0)
    return out


def _norm(s: str) -> str:
    s = s.strip().lower()
    return s[:-1].rstrip() if s.endswith(".") else s


def exact_match_reward(prompts, completions, answers) -> list[float]:
    return [1.0 if _norm(c) == _norm(a) else 0.0 for c, a in zip(completions, answers, strict=True)]


def format_reward(pattern: str) -> Callable:
    rx = re.compile(pattern)
    return lambda prompts, completions, answers: [1.0 if rx.search(c) else 0.0 for c in completions]


class RewardModel:
    """A reward model's scalar on prompt + completion (objective reward: train/objectives/reward_model.py)."""

    def __init__(self, path: str):
        self.score = load_scorer(path)

    def __call__(self, prompts, completions, answers) -> list[float]:
        return self.score([p + c for p, c in zip(prompts, completions, strict=True)])


def build(specs: list[RewardSpec]) -> list[tuple[float, Callable]]:
    """(weight, function) per configured reward."""
    out = []
    for i, s in enumerate(specs):
        if s.name == "math":
            fn = math_reward
        elif s.name == "exact_match":
            fn = exact_match_reward
        elif s.name == "format":
            fn = format_reward(s.pattern)
        elif s.name == "model":
            fn = RewardModel(s.model)
        else:
            fn = resolve_function(s.name, f"rl.rewards.{i}")
        out.append((s.weight, fn))
    return out


def total(rewards: list[tuple[float, Callable]], prompts: list[str], completions: list[str],
          answers: list[str | None], clip: float | None) -> tuple[list[float], list[list[float]]]:
    """(clipped weighted sums, each reward's raw values) for the completions."""
    parts = []
    for _, fn in rewards:
        vals = [float(v) for v in fn(prompts, completions, answers)]
        if len(vals) != len(completions):
            raise ValueError(f"reward {getattr(fn, '__name__', fn)} returned {len(vals)} values for "
                             f"{len(completions)} completions")
        parts.append(vals)
    sums = [sum(w * p[i] for (w, _), p in zip(rewards, parts)) for i in range(len(completions))]
    if clip:
        sums = [max(-clip, min(clip, s)) for s in sums]
    return sums, parts


def load_scorer(path: str):
    """texts → scores with a reward model: a transformers sequence-classification folder (exported by `train
    ckpt export` from a reward-model checkpoint, or any Llama-family one), or such a checkpoint."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from train.generation.load import is_hf_folder

    if not is_hf_folder(path):
        import tempfile

        from train.checkpoint.export_hf import export
        from train.checkpoint.layout import find_checkpoints

        folder = tempfile.mkdtemp(prefix="smoltrain-rm-")
        export(find_checkpoints(path, every=False)[0], folder)
        path = folder
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32, use_safetensors=True,
                                                               trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)

    @torch.no_grad()
    def score(texts: list[str]) -> list[float]:
        out = []
        for t in texts:  # one at a time: no padding to pick the last token from
            ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])
            out.append(float(model(input_ids=ids).logits[0, 0]))
        return out
    return score
