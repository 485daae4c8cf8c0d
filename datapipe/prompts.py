"""RL prompts (`format: prompts`): check a record and render it with the chat template up to and including the
generation prompt, so that what a policy generates next is its answer.

Records are JSONL objects with `prompt`, a string (one user turn) or a list of messages (TRL's
conversational prompt shape), or `messages`, a list of messages; either way the last message must be a
user turn. An optional `answer` (a string, or a number kept as its JSON text) is the reference a
verifiable reward checks (e.g. GSM8K's final answer); `id_field` names the id; every other field of the
record is kept as `extra` (TRL hands a dataset's other columns to reward functions). Message contents
are normalised (`normalize:`) before rendering; `answer` and `extra` are kept verbatim.

While the build runs a prompt is one document: its text is the rendered prompt (exact dedup, MinHash
near-dedup and decontamination act on it as for conversations) and `metadata["prompt"]` its per-document
block metadata (`{"answer": ..., "extra": {...}}`, either key absent when the record has none). The
tokenize stage encodes the text (`add_special_tokens=False`, no EOS, no loss mask: the ids equal
transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`), rejects a
prompt longer than `chat.max_tokens` (`too_long`; prompts are never truncated), and the shard writer
stores the metadata as the block JSON's `doc_meta` (read back by `storage.loader.prompts`).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from storage.chat import ConversationError, render, validate_conversation
from datapipe.config import ChatConfig, NormalizeConfig
from datapipe.normalize import normalize_text

KIND = "prompts"  # metadata["kind"] of a prompt document, and the manifest's source kind


def validate_prompt(record: Any, id_field: str | None = "id") -> tuple[list[dict], dict]:
    """(messages, block metadata) of one record, checked; raises ConversationError with a reason code:
    bad_record (not an object, `prompt`/`messages` of the wrong type, both given, a field JSON cannot store),
    missing_prompt, empty_conversation, unknown_role, non_string_content, not_ending_with_user, bad_answer."""
    if not isinstance(record, dict):
        raise ConversationError("bad_record", f"record is a JSON {type(record).__name__}, not an object")
    given = [k for k in ("prompt", "messages") if record.get(k) is not None]
    if not given:
        raise ConversationError("missing_prompt", "record has neither 'prompt' nor 'messages' "
                                f"(fields: {', '.join(sorted(record))[:200]})")
    if len(given) == 2:
        raise ConversationError("bad_record", "record has both 'prompt' and 'messages'; give one")
    key = given[0]
    raw = record[key]
    if isinstance(raw, str) and key == "prompt":
        raw = [{"role": "user", "content": raw}]
    elif not isinstance(raw, list):
        raise ConversationError("bad_record", f"{key!r} is a {type(raw).__name__}, not "
                                f"{'a string or ' if key == 'prompt' else ''}a list of messages")
    msgs = validate_conversation({"messages": raw}, train_on="all")
    if msgs[-1]["role"] != "user":
        raise ConversationError("not_ending_with_user", f"the last message is a {msgs[-1]['role']} turn; a prompt "
                                "ends with the user's turn")
    meta: dict[str, Any] = {}
    answer = record.get("answer")
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or \
                (isinstance(answer, float) and not math.isfinite(answer)):
            raise ConversationError("bad_answer", f"'answer' is {answer!r}, not a string or a finite number")
        answer = answer if isinstance(answer, str) else json.dumps(answer)
        if not answer.strip():
            raise ConversationError("bad_answer", "'answer' is blank")
        meta["answer"] = answer
    extra = {k: v for k, v in record.items() if k not in ("prompt", "messages", "answer", id_field)}
    if extra:
        try:
            json.dumps(extra, allow_nan=False)
        except ValueError:
            raise ConversationError("bad_record", "a field holds NaN or Infinity, which JSON cannot store") from None
        meta["extra"] = extra
    return msgs, meta


def read_prompt(record: Any, template: str, cfg: ChatConfig, normalize: NormalizeConfig,
                id_field: str | None = "id") -> tuple[str, dict]:
    """(rendered text, document metadata) of a raw record: checked, contents normalised, rendered with the
    generation prompt; raises ConversationError (the `validate_prompt` codes, empty_prompt, template_error)."""
    msgs, meta = validate_prompt(record, id_field)
    for m in msgs:
        for k in ("content", "reasoning_content"):
            if k in m:
                m[k] = normalize_text(m[k], normalize)
    if not msgs[-1]["content"].strip():
        raise ConversationError("empty_prompt", "the user's turn has no text")
    try:
        text, _ = render(template, msgs, add_generation_prompt=True, **cfg.template_vars)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception or a bad value: one bad record
        raise ConversationError("template_error", f"{type(e).__name__}: {e}") from None
    return text, {"kind": KIND, "prompt": meta}


def encode_prompts(tok, docs: list, chat: dict[str, ChatConfig]) -> Iterator[tuple[Any, list[int] | None, str]]:
    """For each prompt document: (doc, token ids, "") or (doc, None, why) when it has more tokens than its
    source's `chat.max_tokens`."""
    for doc, enc in zip(docs, tok.encode_batch_fast([d.text for d in docs], add_special_tokens=False)):
        limit = chat.get(doc.metadata.get("source"), ChatConfig()).max_tokens
        if len(enc.ids) > limit:
            yield doc, None, f"too_long: the prompt has {len(enc.ids):,} tokens, more than chat.max_tokens={limit:,}"
        else:
            yield doc, enc.ids, ""
