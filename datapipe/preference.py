"""Preference pairs (`format: preference`): check a record, render both sides with the chat template, and
encode them into two documents with loss masks on the completion only.

Records are TRL's preference shapes: explicit prompt, `{"prompt", "chosen", "rejected"}`, where `prompt`
is a string (one user turn) or a list of messages and `chosen` / `rejected` a string (one assistant turn)
or a list of messages; or implicit prompt, `{"chosen", "rejected"}` as two full conversations (message
lists) whose longest common prefix of messages is the prompt (TRL's `extract_prompt`).

Each side is rendered as prompt + that side's messages. The completion starts where the rendered prompt
(with the generation prompt when its last turn is not an assistant's) stops being a prefix of the side's
text (TRL's rule); its loss spans are the template's generation spans from there on (`train_on`
assistant), the last of them (`last_assistant`) or everything from there (`all`). Assistant turns inside
the prompt never carry loss.

While the build runs, a pair is ONE document: its text is the chosen text followed by the rejected text,
`metadata["loss_spans"]` the spans of both over that text and `metadata["pair"]` the split point and the
prompt's end on each side. So exact dedup, MinHash near-dedup and decontamination keep or drop whole pairs,
and normalisation leaves the text alone (as for conversations). The tokenize stage splits it into
`ID#chosen` and `ID#rejected` (`encode_pairs`); the shard writer keeps both in one block.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from storage.chat import ConversationError, render, token_mask, validate_conversation
from datapipe.config import ChatConfig, NormalizeConfig
from datapipe.normalize import normalize_text

SIDES = ("chosen", "rejected")


def pair_id(doc_id: str) -> str:
    """The pair id of a side's document id (`ID#chosen` / `ID#rejected` → `ID`)."""
    for side in SIDES:
        if doc_id.endswith("#" + side):
            return doc_id[:-len(side) - 1]
    raise ValueError(f"document {doc_id!r} is not a side of a preference pair (no #chosen / #rejected suffix)")


def _messages(value: Any, key: str, role: str) -> list:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise ConversationError("non_string_content", f"{key!r} is a {type(value).__name__}, not a string or a list "
                            "of messages")


def validate_pair(record: Any) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) message lists of one record, checked; raises ConversationError with the
    chat reason codes (bad_record, unknown_role, non_string_content, ...) or missing_messages (no
    chosen/rejected), missing_prompt (no prompt, and the sides share no leading message), no_assistant (a
    completion without an assistant turn), identical_completions, empty_completion."""
    if not isinstance(record, dict):
        raise ConversationError("bad_record", f"record is a JSON {type(record).__name__}, not an object")
    missing = [k for k in SIDES if k not in record]
    if missing:
        raise ConversationError("missing_messages", f"record has no {' or '.join(map(repr, missing))} "
                                f"(fields: {', '.join(sorted(record))[:200]})")
    chosen, rejected = record["chosen"], record["rejected"]
    if chosen == rejected:
        raise ConversationError("identical_completions", "'chosen' and 'rejected' are the same")
    if record.get("prompt") is None:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise ConversationError("missing_prompt", "no 'prompt', and 'chosen'/'rejected' are not message lists "
                                    "sharing a prompt")
        k = 0
        while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
            k += 1
        if k == 0:
            raise ConversationError("missing_prompt", "no 'prompt', and 'chosen'/'rejected' share no leading message")
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    else:
        prompt = _messages(record["prompt"], "prompt", "user")
        if not prompt:
            raise ConversationError("missing_prompt", "'prompt' is an empty list")
    comps = [_messages(v, side, "assistant") for v, side in ((chosen, "chosen"), (rejected, "rejected"))]
    out = [validate_conversation({"messages": prompt}, train_on="all")]
    for side, comp in zip(SIDES, comps):
        if not comp:
            raise ConversationError("empty_completion", f"{side!r} has no messages")
        try:
            out.append(validate_conversation({"messages": comp}, train_on="assistant"))
        except ConversationError as e:
            raise ConversationError(e.reason, f"{side}: {str(e).split(': ', 1)[1]}") from None
    if out[1] == out[2]:
        raise ConversationError("identical_completions", "'chosen' and 'rejected' are the same")
    return out[0], out[1], out[2]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def render_pair(template: str, prompt: list[dict], chosen: list[dict], rejected: list[dict], *,
                train_on: str = "assistant", **template_vars: Any) -> tuple[str, dict]:
    """(text, metadata) of one pair as a build document: the chosen then the rejected rendering, the
    completions' loss spans over that text, and `pair` = {split, prompt_end: [chosen, rejected]}.
    Raises ConversationError identical_completions (equal renderings) or no_loss_tokens."""
    gen = bool(prompt) and prompt[-1]["role"] != "assistant"
    ptext = render(template, prompt, add_generation_prompt=gen, **template_vars)[0] if prompt else ""
    texts, spans, ends = [], [], []
    for comp in (chosen, rejected):
        text, sp = render(template, prompt + comp, train_on="assistant", **template_vars)
        p = _common_prefix(ptext, text)
        if train_on == "all":
            sp = [(p, len(text))]
        else:
            sp = [(max(a, p), b) for a, b in sp if b > p]
            sp = sp[-1:] if train_on == "last_assistant" else sp
        if not any(b > a for a, b in sp):
            raise ConversationError("no_loss_tokens", "the template marked no text of the completion for loss")
        texts.append(text)
        spans.append(sp)
        ends.append(p)
    if texts[0] == texts[1]:
        raise ConversationError("identical_completions", "'chosen' and 'rejected' render to the same text")
    split = len(texts[0])
    loss_spans = [list(s) for s in spans[0]] + [[a + split, b + split] for a, b in spans[1]]
    return texts[0] + texts[1], {"kind": "preference", "loss_spans": loss_spans,
                                 "pair": {"split": split, "prompt_end": ends}}


def read_pair(record: Any, template: str, cfg: ChatConfig, normalize: NormalizeConfig) -> tuple[str, dict]:
    """(text, metadata) of a raw record (checked, contents normalised, rendered); raises ConversationError."""
    prompt, chosen, rejected = validate_pair(record)
    for m in (*prompt, *chosen, *rejected):
        for k in ("content", "reasoning_content"):
            if k in m:
                m[k] = normalize_text(m[k], normalize)
    for side, comp in zip(SIDES, (chosen, rejected)):
        if not any(m["content"].strip() or m.get("reasoning_content", "").strip() for m in comp):
            raise ConversationError("empty_completion", f"{side!r} has no text")
    try:
        return render_pair(template, prompt, chosen, rejected, train_on=cfg.train_on, **cfg.template_vars)
    except ConversationError:
        raise
    except Exception as e:  # noqa: BLE001 - a template's raise_exception or a bad value: one bad record
        raise ConversationError("template_error", f"{type(e).__name__}: {e}") from None


class PairRejected(ValueError):
    def __init__(self, reason: str, msg: str):
        super().__init__(f"{reason}: {msg}")
        self.reason = reason


def encode_pairs(tok, docs: list, chat: dict[str, ChatConfig]) -> Iterator[tuple[Any, list | PairRejected, bool]]:
    """For each pair document: (doc, [(side id, tokens, mask), (side id, tokens, mask)] or PairRejected
    (prompt_too_long: the tokens before the completion exceed `max_tokens`; too_long: a side does, unless
    `truncate` cuts it and something trainable remains), truncated)."""
    texts = []
    for d in docs:
        split = d.metadata["pair"]["split"]
        texts += [d.text[:split], d.text[split:]]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    for i, doc in enumerate(docs):
        cfg = chat.get(doc.metadata.get("source"), ChatConfig())
        info, limit = doc.metadata["pair"], cfg.max_tokens
        split = info["split"]
        sides, cut = [], False
        for j, side in enumerate(SIDES):
            enc = encs[2 * i + j]
            off = split if j else 0
            spans = [(a - off, b - off) for a, b in doc.metadata["loss_spans"] if (a >= split) == bool(j)]
            starts = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
            n_prompt = int((starts < info["prompt_end"][j]).sum())
            sides.append((side, enc.ids, token_mask(enc, spans, len(enc.ids)), n_prompt))
        worst = max(n for *_, n in sides)
        if worst > limit:
            yield doc, PairRejected("prompt_too_long", f"the prompt has {worst:,} tokens, more than "
                                    f"chat.max_tokens={limit:,}"), False
            continue
        out, bad = [], None
        for side, toks, mask, _ in sides:
            if len(toks) > limit:
                if cfg.truncate and mask[:limit].any():
                    toks, mask, cut = toks[:limit], mask[:limit], True
                else:
                    why = "; nothing to train on before the cut" if cfg.truncate else ""
                    bad = PairRejected("too_long", f"{side} has {len(toks):,} tokens, more than "
                                       f"chat.max_tokens={limit:,}{why}")
                    break
            out.append((f"{doc.id}#{side}", toks, mask))
        yield doc, bad or out, cut and bad is None
