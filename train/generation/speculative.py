"""Speculative decoding (`train generate --draft CKPT|HF`): transformers' assisted generation, a small draft
model proposing tokens that the target verifies in one forward pass, with the acceptance rate measured.

transformers runs it at batch size 1 only. Greedy output equals the target's plain greedy output (the
target accepts a draft token only if it is its own argmax). The acceptance rate is counted from the two
models' forward calls: every target call verifies one round and yields its accepted draft tokens plus one
of its own, and every draft call proposes one token, so accepted / proposed = (new tokens − target calls)
/ draft calls. Both models must share the vocabulary (the draft's may be padded to the same size).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from train.generation.engine import Completion, SamplingParams
from train.generation.load import GenerateError, Loaded


@dataclass
class AssistStats:
    new_tokens: int
    target_calls: int
    draft_calls: int
    seconds: float

    @property
    def acceptance(self) -> float:
        return (self.new_tokens - self.target_calls) / self.draft_calls if self.draft_calls else 0.0


def _counter(model) -> tuple[list[int], object]:
    calls = [0]

    def hook(*_):
        calls[0] += 1
    return calls, model.register_forward_hook(hook)


def check_pair(target: Loaded, draft: Loaded) -> None:
    vt, vd = target.model.config.vocab_size, draft.model.config.vocab_size
    if vt != vd or len(target.tokenizer) != len(draft.tokenizer):
        raise GenerateError(f"the draft's vocabulary ({len(draft.tokenizer)} tokens, {vd} rows) differs from the "
                            f"target's ({len(target.tokenizer)} tokens, {vt} rows): speculative decoding needs one")


def assisted(target: Loaded, draft: Loaded, prompt: list[int], params: SamplingParams,
             stats: list | None = None) -> Completion:
    """One completion of `prompt` by the target with the draft's proposals; AssistStats appended to `stats`."""
    from transformers import GenerationConfig

    check_pair(target, draft)
    stop = sorted(set(target.eos_ids) | set(params.stop_token_ids))
    kw = dict(max_new_tokens=params.max_new_tokens, eos_token_id=stop or None, pad_token_id=stop[0] if stop else 0)
    # top_k 0: off (None would leave transformers' default top-k 50 in place)
    kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k) \
        if params.temperature > 0 else kw.update(do_sample=False)
    n = len(target.tokenizer)
    if target.model.config.vocab_size > n:
        kw["suppress_tokens"] = list(range(n, target.model.config.vocab_size))
    x = torch.tensor([prompt])
    tcalls, th = _counter(target.model)
    dcalls, dh = _counter(draft.model)
    try:
        if params.temperature > 0:
            torch.manual_seed(params.seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = target.model.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft.model,
                                        generation_config=GenerationConfig(**kw))
        seconds = time.perf_counter() - t0
    finally:
        th.remove()
        dh.remove()
    new = out[0, len(prompt):].tolist()
    if stats is not None:
        stats.append(AssistStats(len(new), tcalls[0], dcalls[0], seconds))
    return Completion(new, "stop" if new and new[-1] in stop else "length")
