"""`train generate`: talk to a checkpoint or a Hugging Face folder: the chat template around the user's
message, then generation (greedy, or sampled) through the engine until the template's end-of-turn token
or EOS; with `--draft`, assisted (speculative) generation with a smaller model (train.generation.speculative).

The chat template: the folder's / checkpoint's (train.generation.load), else built-in ChatML
(storage.chat, as SFT data is rendered). Stop tokens: EOS plus the template's end-of-turn token (the added
token that follows an assistant message in the rendered template, e.g. `<|im_end|>`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from train.generation.engine import Engine, SamplingParams
from train.generation.load import GenerateError, Loaded, load

__all__ = ["GenerateError", "Generation", "generate", "load", "chat_prompt"]


@dataclass
class Generation:
    text: str                                   # the reply, decoded without special tokens
    prompt_text: str                            # what was encoded (template rendered)
    prompt_ids: list[int]
    new_ids: list[int]                          # generated ids, the stop token included when one was hit
    stop_ids: list[int] = field(default_factory=list)


def end_of_turn_ids(template: str, tok) -> list[int]:
    """Added tokens that the template puts right after an assistant message."""
    marker = "Zq7xReplyMarker"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                       chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this: no end-of-turn token known
        return []
    suffix = text[text.rfind(marker) + len(marker):].lstrip() if marker in text else ""
    return [i for s, i in tok.get_added_vocab().items() if s and suffix.startswith(s)]


def chat_prompt(loaded: Loaded, messages: list[dict]) -> tuple[str, list[int]]:
    """(prompt text with the generation prompt, stop ids: EOS and the end-of-turn token) of a conversation."""
    from storage.chat import BUILTIN_TEMPLATES, render

    template = loaded.chat_template or BUILTIN_TEMPLATES["chatml"]
    text = render(template, messages, add_generation_prompt=True)[0]
    stop = list(loaded.eos_ids)
    stop += [i for i in end_of_turn_ids(template, loaded.tokenizer) if i not in stop]
    return text, stop


def generate(path: str, prompt: str, *, system: str | None = None, chat: bool = True, max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, loaded: Loaded | None = None,
             draft: Loaded | None = None, prompt_lookup: int = 0, stats: list | None = None) -> Generation:
    """Reply to `prompt` (a user message; with chat=False the raw text). Greedy when temperature is 0. With a
    `draft` (AssistStats) or `prompt_lookup` (train.generation.ngram.Stats) speculative decoding's counts are
    appended to `stats`."""
    loaded = loaded or load(path)
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text, stop = chat_prompt(loaded, messages)
    else:
        text, stop = prompt, list(loaded.eos_ids)
    tok = loaded.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise GenerateError("the prompt encodes to no tokens")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            stop_token_ids=tuple(stop))
    if draft is not None:
        from train.generation.speculative import assisted

        new = assisted(loaded, draft, ids, params, stats).token_ids
    else:
        engine = Engine(loaded.model, tok, stop, backend="padded", prompt_lookup=prompt_lookup)
        new = engine.generate([ids], params)[0][0].token_ids
        if prompt_lookup and stats is not None:
            stats.append(engine.lookup_stats)
    body = new[:-1] if new and new[-1] in stop else new
    return Generation(tok.decode(body, skip_special_tokens=True), text, ids, new, stop)
