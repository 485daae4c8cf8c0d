"""Chat templates: text, tokens and loss masks identical to transformers' apply_chat_template (built-in
templates, with {% generation %} markers), train_on variants, template loading, conversation checks."""
from __future__ import annotations

import json

import numpy as np
import pytest
from testutil import read_corpus, require

from storage.chat import (BUILTIN_TEMPLATES, ConversationError, load_template, render, template_special_tokens,
                           token_mask, validate_conversation)
from datapipe.tokenize import train_bpe
from storage.config import ConfigError

SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Be kind. /no_think"}, {"role": "user", "content": "Tell me a joke"},
     {"role": "assistant", "content": "Why did the chicken cross the road?"},
     {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "To get to the other side."}],
    [{"role": "system", "content": "/think Reason first."}, {"role": "user", "content": "Is 91 prime?"},
     {"role": "assistant", "content": "No: 91 = 7 × 13.", "reasoning_content": "Try 7: 7*13=91."}],
    [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Calling the tool."},
     {"role": "tool", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
     {"role": "assistant", "content": "It is 21 °C and clear."}],
    [{"role": "user", "content": "Ünïcödé: 日本語のテキスト, emoji 😀🎉, Ελληνικά, עברית"},
     {"role": "assistant", "content": "Noted — 日本語 and 😀 too."}],
    [{"role": "user", "content": "  leading and trailing spaces  "}, {"role": "assistant", "content": "\n\nnewlines\n"}],
    [{"role": "user", "content": "empty answer follows"}, {"role": "assistant", "content": ""}],
    [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}],
    [{"role": "user", "content": "code please"},
     {"role": "assistant", "content": "```python\ndef f(x):\n    return x * 2\n```"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"},
     {"role": "assistant", "content": "f"}],
    [{"role": "user", "content": "tabs\tand\ttabs"}, {"role": "assistant", "content": "ok\tok"}],
    [{"role": "user", "content": "Quote \"this\" and 'that' {{ not jinja }} {% raw %}"},
     {"role": "assistant", "content": "{% endraw %} <b>html</b> & stuff"}],
    [{"role": "system", "content": "/no_think"}, {"role": "user", "content": "only a flag in the system prompt"},
     {"role": "assistant", "content": "Understood."}],
    [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y " * 150}],
    [{"role": "user", "content": "mid-conversation system"}, {"role": "system", "content": "Switch to French."},
     {"role": "user", "content": "Bonjour"}, {"role": "assistant", "content": "Bonjour !"}],
    [{"role": "user", "content": "Can you think?"},
     {"role": "assistant", "content": "Yes.", "reasoning_content": "  The user asks about thinking.  "}],
    [{"role": "user", "content": "numbers 1234567890 3.14159 -42"}, {"role": "assistant", "content": "e = 2.71828"}],
    [{"role": "tool", "content": "tool output first"}, {"role": "assistant", "content": "Read it."}],
    [{"role": "user", "content": "special text <|im_end|> inside user content"},
     {"role": "assistant", "content": "and <think> inside the answer </think>"}],
]
VARIANTS = [("chatml", {}), ("smollm3", {}), ("smollm3", {"enable_thinking": False}),
            ("smollm3", {"enable_thinking": True})]


@pytest.fixture(scope="module")
def tokenizers_pair(tmp_path_factory):
    """(tokenizers.Tokenizer, transformers PreTrainedTokenizerFast) from one trained tokenizer.json."""
    transformers = require("transformers")
    from tokenizers import Tokenizer

    texts = [d["text"] for d in read_corpus("fortunes", 400)]
    path = train_bpe(texts, 800, "<|endoftext|>", str(tmp_path_factory.mktemp("chattok") / "tokenizer.json"),
                     special_tokens=SPECIALS)
    return Tokenizer.from_file(path), transformers.PreTrainedTokenizerFast(tokenizer_file=path)


def _ours(tok, template, conv, train_on="assistant", **kw):
    text, spans = render(BUILTIN_TEMPLATES[template], conv, train_on=train_on, **kw)
    enc = tok.encode(text, add_special_tokens=False)
    return text, enc.ids, token_mask(enc, spans, len(enc.ids))


@pytest.mark.parametrize("template,kw", VARIANTS, ids=[f"{t}-{k}" for t, k in VARIANTS])
def test_parity_with_transformers(tokenizers_pair, template, kw):
    tok, hf = tokenizers_pair
    n_masked = 0
    for conv in CONVERSATIONS:
        text, ids, mask = _ours(tok, template, conv, **kw)
        want = hf.apply_chat_template(conv, chat_template=BUILTIN_TEMPLATES[template], tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True, **kw)
        assert text == hf.apply_chat_template(conv, chat_template=BUILTIN_TEMPLATES[template], tokenize=False, **kw)
        assert ids == list(want["input_ids"]), conv
        assert mask.tolist() == list(want["assistant_masks"]), conv
        assert mask.dtype == np.uint8
        n_masked += int(mask.sum())
        # generation prompts match too
        for conv_prefix in (conv[:1], conv):
            ours = render(BUILTIN_TEMPLATES[template], conv_prefix, add_generation_prompt=True, **kw)[0]
            assert ours == hf.apply_chat_template(conv_prefix, chat_template=BUILTIN_TEMPLATES[template],
                                                  tokenize=False, add_generation_prompt=True, **kw)
    assert n_masked > 100


def test_special_tokens_are_single_and_masks_cover_answers(tokenizers_pair):
    tok, hf = tokenizers_pair
    for t in SPECIALS:
        assert len(tok.encode(t, add_special_tokens=False).ids) == 1
    conv = CONVERSATIONS[2]
    _, ids, mask = _ours(tok, "chatml", conv)
    masked = hf.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "Why did the chicken cross the road?<|im_end|>To get to the other side.<|im_end|>"


def test_smollm3_flags(tokenizers_pair):
    sm = BUILTIN_TEMPLATES["smollm3"]
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert "Reasoning Mode: /think" in render(sm, conv)[0]
    assert "Reasoning Mode: /no_think" in render(sm, conv, enable_thinking=False)[0]
    flagged = [{"role": "system", "content": "Be brief. /no_think"}, *conv]
    text, spans = render(sm, flagged, enable_thinking=True)  # the system flag wins over the variable
    assert "Reasoning Mode: /no_think" in text and "/no_think<" not in text and "Be brief.<|im_end|>" in text
    assert "<think>\n\n</think>\n" in text and [text[a:b] for a, b in spans] == ["a<|im_end|>"]
    think = [{"role": "system", "content": "/think"}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    text, spans = render(sm, think, enable_thinking=False)
    assert "Reasoning Mode: /think" in text and [text[a:b] for a, b in spans] == ["<think>\nr\n</think>\na<|im_end|>"]
    assert template_special_tokens(sm) == SPECIALS
    assert template_special_tokens(BUILTIN_TEMPLATES["chatml"]) == SPECIALS[:2]


def test_train_on_variants(tokenizers_pair):
    tok, hf = tokenizers_pair
    conv = CONVERSATIONS[10]
    _, ids, every = _ours(tok, "chatml", conv)
    _, ids_last, last = _ours(tok, "chatml", conv, train_on="last_assistant")
    _, ids_all, whole = _ours(tok, "chatml", conv, train_on="all")
    assert ids == ids_last == ids_all
    assert whole.tolist() == [1] * len(ids)
    assert hf.decode([i for i, m in zip(ids, last) if m]) == "f<|im_end|>"
    assert np.all(last <= every) and last.sum() < every.sum()
    text, spans = render(BUILTIN_TEMPLATES["chatml"], conv, train_on="all")
    assert spans == [(0, len(text))]
    with pytest.raises(ValueError, match="train_on"):
        render(BUILTIN_TEMPLATES["chatml"], conv, train_on="user")


def test_token_mask_matches_transformers_pass_on_random_spans(tokenizers_pair):
    """The vectorised pass equals the token-by-token pass transformers runs (also on odd spans)."""
    tok, _ = tokenizers_pair
    text = " ".join(d["text"] for d in read_corpus("fortunes", 5))
    enc = tok.encode(text, add_special_tokens=False)
    rng = np.random.default_rng(0)

    def reference(spans):
        out, j = [0] * len(enc.ids), 0
        for i, (a, b) in enumerate(enc.offsets):
            while j < len(spans) and a >= spans[j][1]:
                j += 1
            if j == len(spans):
                break
            out[i] = int(b > spans[j][0])
        return out

    for _ in range(50):
        cuts = np.sort(rng.choice(len(text) + 1, 2 * int(rng.integers(1, 6)), replace=False)).tolist()
        spans = list(zip(cuts[::2], cuts[1::2]))
        assert token_mask(enc, spans, len(enc.ids)).tolist() == reference(spans)
        rng.shuffle(spans)  # unordered spans take the loop
        assert token_mask(enc, spans, len(enc.ids)).tolist() == reference(spans)
    full = token_mask(enc, [(0, len(text))])
    assert full.all() and token_mask(enc, [(0, len(text))], 3).tolist() == [1, 1, 1]  # cut to n_tokens
    assert token_mask(enc, [(0, len(text))], len(full) + 2).tolist()[-3:] == [1, 0, 0]  # zero-padded


def test_load_template(tmp_path):
    assert load_template("chatml") == BUILTIN_TEMPLATES["chatml"]
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert "for m in messages" in load_template(str(tmp_path / "t.jinja"))
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": BUILTIN_TEMPLATES["smollm3"]}))
    assert load_template(str(cfg)) == BUILTIN_TEMPLATES["smollm3"]
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                 {"name": "default", "template": "{{ 1 }}"}]}))
    assert load_template(str(cfg)) == "{{ 1 }}"
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(ConfigError, match="none named 'default'"):
        load_template(str(cfg))
    cfg.write_text(json.dumps({"model_max_length": 8}))
    with pytest.raises(ConfigError, match="no 'chat_template' key"):
        load_template(str(cfg))
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not compile"):
        load_template(str(tmp_path / "bad.jinja"))
    with pytest.raises(ConfigError, match="neither a built-in"):
        load_template("chatml2")


@pytest.mark.parametrize("record,reason", [
    (["not", "an", "object"], "bad_record"),
    ({"text": "plain"}, "missing_messages"),
    ({"messages": []}, "empty_conversation"),
    ({"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": ["a", "list"]}, {"role": "assistant", "content": "y"}]},
     "non_string_content"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]}, "non_string_content"),
    ({"prompt": "q", "completion": 3}, "non_string_content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}, "no_assistant"),
])
def test_validate_conversation_reasons(record, reason):
    with pytest.raises(ConversationError) as ei:
        validate_conversation(record)
    assert ei.value.reason == reason and str(ei.value).startswith(reason)


def test_validate_conversation_converts():
    assert validate_conversation({"prompt": "q", "completion": "a"}) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    msgs = validate_conversation({"messages": [{"role": "user", "content": "u", "extra": 1},
                                               {"role": "assistant", "content": "a", "thinking": "t"}]})
    assert msgs == [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "reasoning_content": "t"}]
    # without assistant turns a conversation is fine when training on everything
    assert validate_conversation({"messages": [{"role": "user", "content": "u"}]}, train_on="all")
