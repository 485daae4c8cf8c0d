"""Chat templates: render a conversation to text plus the character spans that carry loss, exactly as
transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` does, and turn those spans into
a per-token loss mask.

Templates are Jinja, rendered in the same sandbox transformers uses (ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, its `tojson`, `raise_exception`, `strftime_now`, `dict`, `namespace`, and a
`{% generation %}` extension that records where each generated span starts and ends), so the text and
spans match transformers' byte for byte. The built-in templates wrap each assistant turn's content and its
`<|im_end|>` in `{% generation %}` blocks; `chatml` is plain ChatML, `smollm3` follows SmolLM3's template
(a `/think` or `/no_think` flag in the system message, else the `enable_thinking` variable, sets the
reasoning mode; in `/no_think` mode an empty `<think>` block precedes each answer, outside the loss).
"""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy as np

from storage.config import ConfigError

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "last_assistant", "all")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, in its order

CHATML = r"""{#- ChatML; each assistant turn's content and end-of-turn token are a generation (loss) span -#}
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- generation %}
{{- message['content'] + '<|im_end|>' }}
{%- endgeneration %}
{{- '\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

SMOLLM3 = r"""{#- SmolLM3-style: reasoning mode from a /think or /no_think system flag, else enable_thinking -#}
{%- if enable_thinking is defined and not enable_thinking %}
{%- set reasoning_mode = '/no_think' %}
{%- else %}
{%- set reasoning_mode = '/think' %}
{%- endif %}
{%- set instructions = '' %}
{%- if messages and messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] %}
{%- if '/no_think' in system_message %}
{%- set reasoning_mode = '/no_think' %}
{%- elif '/think' in system_message %}
{%- set reasoning_mode = '/think' %}
{%- endif %}
{%- set instructions = system_message.replace('/no_think', '').replace('/think', '').strip() %}
{%- endif %}
{{- '<|im_start|>system\n## Metadata\n\nReasoning Mode: ' + reasoning_mode + '\n\n## Custom Instructions\n\n' }}
{%- if instructions %}
{{- instructions }}
{%- else %}
{{- 'You are a helpful AI assistant named SmolLM, trained by Hugging Face.' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if reasoning_mode == '/no_think' %}
{{- '<think>\n\n</think>\n' }}
{%- endif %}
{%- generation %}
{%- if reasoning_mode == '/think' and message['reasoning_content'] is defined %}
{{- '<think>\n' + message['reasoning_content'].strip() + '\n</think>\n' }}
{%- endif %}
{{- message['content'] + '<|im_end|>' }}
{%- endgeneration %}
{{- '\n' }}
{%- elif message['role'] != 'system' or not loop.first %}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if reasoning_mode == '/no_think' %}
{{- '<think>\n\n</think>\n' }}
{%- endif %}
{%- endif %}
"""

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "smollm3": SMOLLM3}


class ConversationError(ValueError):
    """A record that is not a trainable conversation; `reason` is a short code (counted in build stats)."""

    def __init__(self, reason: str, msg: str):
        super().__init__(f"{reason}: {msg}")
        self.reason = reason


def load_template(spec: str) -> str:
    """The Jinja text of a built-in template name, of a tokenizer_config.json's `chat_template` (the string
    form, or the list-of-{name, template} form's "default"), or of a .jinja file. Checks that it compiles."""
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    if not os.path.isfile(spec):
        raise ConfigError(f"chat template {spec!r} is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) nor an "
                          "existing tokenizer_config.json or .jinja file")
    with open(spec, encoding="utf-8") as f:
        raw = f.read()
    if spec.endswith(".json"):
        try:
            tmpl = json.loads(raw).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ConfigError(f"chat template {spec}: not a JSON object ({e})") from None
        if tmpl is None:
            raise ConfigError(f"chat template {spec}: has no 'chat_template' key")
        if isinstance(tmpl, list):
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            if not isinstance(named.get("default"), str):
                raise ConfigError(f"chat template {spec}: 'chat_template' lists templates "
                                  f"{sorted(str(n) for n in named)} but none named 'default'")
            tmpl = named["default"]
        if not isinstance(tmpl, str):
            raise ConfigError(f"chat template {spec}: 'chat_template' is a {type(tmpl).__name__}, not a string")
        raw = tmpl
    try:
        compile_template(raw)
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError, shown with the file
        raise ConfigError(f"chat template {spec}: does not compile ({type(e).__name__}: {e})") from None
    return raw


def template_special_tokens(template: str) -> list[str]:
    """Control tokens the template writes, in order of first use: every `<|...|>` token, plus `<think>`
    and `</think>` when it uses them. A build's tokenizer must hold each as a single token."""
    found = re.findall(r"<\|[A-Za-z0-9_.:-]{1,64}\|>|</?think>", template)
    return list(dict.fromkeys(found))


@lru_cache(maxsize=16)
def compile_template(template: str):
    """The template compiled in a jinja2 environment equal to transformers' chat-template environment."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._tracking: ContextVar = ContextVar("assistant_tracker", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller) -> str:
            rv = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(rv)))
            return rv

        @contextmanager
        def activate_tracker(self, blocks: list, spans: list):
            if self._tracking.get() is not None:
                raise ValueError("AssistantTracker should not be reused before closed")
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        r = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": r, **m, "reasoning_content": r} if r is not None else dict(m))
    return out


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = False, train_on: str = "assistant",
           **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """(text, loss spans) of `messages` rendered by `template` (Jinja text): with `train_on` "assistant"
    every `{% generation %}` span, "last_assistant" only the last one, "all" the whole text. Extra
    keyword arguments are template variables (e.g. enable_thinking=False); `tools` and `documents` too."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    compiled = compile_template(template)
    tools, documents = kwargs.pop("tools", None), kwargs.pop("documents", None)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with compiled.environment.activate_tracker(blocks, spans):
        for b in compiled.generate(messages=_alias_reasoning(messages), tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **kwargs):
            blocks.append(b)
        text = "".join(blocks)
    if train_on == "all":
        return text, [(0, len(text))]
    return text, spans[-1:] if train_on == "last_assistant" else list(spans)


def validate_conversation(record: Any, *, train_on: str = "assistant") -> list[dict]:
    """The messages of one JSONL record (`messages: [{role, content}, ...]`, or `prompt` and `completion`
    strings, made a user and an assistant turn), checked; raises ConversationError (reason codes
    bad_record, missing_messages, empty_conversation, unknown_role, non_string_content, no_assistant).
    Messages keep `role`, `content` and a string `reasoning_content` (or `thinking` / `reasoning`)."""
    if not isinstance(record, dict):
        raise ConversationError("bad_record", f"record is a JSON {type(record).__name__}, not an object")
    if "messages" in record:
        raw = record["messages"]
        if not isinstance(raw, list):
            raise ConversationError("bad_record", f"'messages' is a {type(raw).__name__}, not a list")
    elif "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise ConversationError("non_string_content", f"{key!r} is a {type(record.get(key)).__name__}, "
                                        "not a string")
        raw = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    else:
        raise ConversationError("missing_messages", "record has neither 'messages' nor 'prompt'/'completion' "
                                f"(fields: {', '.join(sorted(record))[:200]})")
    if not raw:
        raise ConversationError("empty_conversation", "conversation has no messages")
    msgs = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ConversationError("bad_record", f"message {i} is a {type(m).__name__}, not an object")
        role = m.get("role")
        if role not in ROLES:
            raise ConversationError("unknown_role", f"message {i} has role {role!r} (roles: {', '.join(ROLES)})")
        content = m.get("content")
        if not isinstance(content, str):
            raise ConversationError("non_string_content", f"message {i} ({role}) content is a "
                                    f"{type(content).__name__}, not a string")
        msg = {"role": role, "content": content}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ConversationError("non_string_content", f"message {i} ({role}) reasoning is a "
                                        f"{type(reasoning).__name__}, not a string")
            msg["reasoning_content"] = reasoning
        msgs.append(msg)
    if train_on != "all" and not any(m["role"] == "assistant" for m in msgs):
        raise ConversationError("no_assistant", f"no assistant turn to train on (train_on: {train_on})")
    return msgs


def token_mask(encoding, spans: list[tuple[int, int]], n_tokens: int | None = None) -> np.ndarray:
    """uint8 loss mask of a `tokenizers` Encoding of the rendered text: 1 for every token overlapping a span,
    as transformers computes `assistant_masks` (one ordered pass over token offsets and spans). With
    `n_tokens` the mask is cut (or zero-padded) to that length."""
    offs = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    n = len(offs)
    mask = np.zeros(n, dtype=np.uint8)
    if spans and n:
        sp = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        if np.all(np.diff(sp[:, 1]) >= 0):
            # the pass's span pointer at token i: first span ending after the largest start seen so far
            ptr = np.searchsorted(sp[:, 1], np.maximum.accumulate(offs[:, 0]), side="right")
            ok = ptr < len(sp)
            mask[ok] = offs[ok, 1] > sp[ptr[ok], 0]
        else:  # unordered spans (a custom template): the same pass, token by token
            j = 0
            for i, (a, b) in enumerate(offs.tolist()):
                while j < len(sp) and a >= sp[j][1]:
                    j += 1
                if j == len(sp):
                    break
                mask[i] = b > sp[j][0]
    if n_tokens is not None and n_tokens != n:
        mask = mask[:n_tokens] if n_tokens < n else np.concatenate([mask, np.zeros(n_tokens - n, np.uint8)])
    return mask
