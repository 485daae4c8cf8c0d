"""Tokenizer side of a Hugging Face export: tokenizer.json plus the files that tell transformers (and
lm-eval's HF backend) which token is EOS / BOS / padding: tokenizer_config.json, special_tokens_map.json,
and the token ids for config.json and generation_config.json.

The EOS token is the training dataset's (its manifest records `tokenizer.eos_id`; the dataset is found
from the tokenizer path recorded in the checkpoint, `<dataset>/<manifest tokenizer.file>`). As for SmolLM
and GPT-2, BOS and padding are the same token and nothing is added when encoding (add_bos_token false):
ids are exactly those the model was trained on.
"""
from __future__ import annotations

import json
import os

from storage import atomic, fs

TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _parents(url: str, levels: int = 4) -> list[str]:
    """Up to `levels` enclosing folders of a local path or URL, nearest first."""
    cur = os.path.abspath(fs.local_path(url)) if fs.is_local(url) else url.rstrip("/")
    out = []
    for _ in range(levels):
        head, _, _ = cur.rpartition("/")
        if not head or head.endswith(":/") or head.endswith("://"):
            break
        out.append(head)
        cur = head
    return out


def dataset_manifest(tokenizer_url: str):
    """The manifest of the dataset whose tokenizer file is `tokenizer_url` (None: no such dataset next to it)."""
    from storage.manifest import MANIFEST_NAME, read_manifest

    def norm(u: str) -> str:
        return os.path.normpath(os.path.abspath(fs.local_path(u))) if fs.is_local(u) else u

    target = norm(tokenizer_url)
    for root in _parents(tokenizer_url):
        try:
            if not fs.exists(fs.join(root, MANIFEST_NAME)):
                continue
            m = read_manifest(root)
        except Exception:  # not a dataset (unreadable or another kind of manifest.json): keep looking
            continue
        if norm(fs.join(root, m.tokenizer.file)) == target:
            return m
    return None


def dataset_eos_id(tokenizer_url: str) -> int | None:
    """EOS id from the manifest of the dataset whose tokenizer file is `tokenizer_url` (None: no such
    dataset next to it)."""
    m = dataset_manifest(tokenizer_url)
    return int(m.tokenizer.eos_id) if m is not None else None


def dataset_chat_template(tokenizer_url: str) -> str | None:
    """The chat template (Jinja) recorded in that dataset's manifest (`chat_template`), if any."""
    m = dataset_manifest(tokenizer_url)
    t = getattr(m, "chat_template", None) if m is not None else None
    try:  # a built-in template's name (storage.chat) stands for its text
        from storage.chat import BUILTIN_TEMPLATES
    except ImportError:
        BUILTIN_TEMPLATES = {}
    return BUILTIN_TEMPLATES.get(t, t) if t else None


def single_special_token(tok_json: dict) -> str | None:
    """The tokenizer's only special added token (what `datapipe tokenizer train` adds: the EOS), if there
    is exactly one."""
    special = [t["content"] for t in tok_json.get("added_tokens") or [] if t.get("special")]
    return special[0] if len(special) == 1 else None


def resolve_eos(tok_bytes: bytes, tokenizer_url: str | None, eos_token: str | None = None) -> tuple[str, int] | None:
    """(EOS string, id): `eos_token` if given, else the dataset manifest's EOS, else the tokenizer's single
    special token; None when none of these is known."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_bytes.decode())
    if eos_token is None and tokenizer_url:
        eos_id = dataset_eos_id(tokenizer_url)
        if eos_id is not None:
            s = tok.id_to_token(eos_id)
            if s is None:
                raise ValueError(f"dataset EOS id {eos_id} is not in the tokenizer {tokenizer_url}")
            return s, eos_id
    if eos_token is None:
        eos_token = single_special_token(json.loads(tok_bytes))
        if eos_token is None:
            return None
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"EOS token {eos_token!r} is not in the tokenizer")
    return eos_token, eos_id


def write_tokenizer_files(out_dir: str, tok_bytes: bytes, eos: tuple[str, int] | None,
                          model_max_length: int, chat_template: str | None = None) -> dict:
    """tokenizer.json, and with a known EOS tokenizer_config.json (with `chat_template` when given) and
    special_tokens_map.json; returns the special token ids for config.json / generation_config.json (empty
    without an EOS)."""
    atomic.write_bytes(os.path.join(out_dir, "tokenizer.json"), tok_bytes)
    if eos is None:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):  # of an earlier export here
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        return {}
    eos_str, eos_id = eos
    special = {"bos_token": eos_str, "eos_token": eos_str, "pad_token": eos_str}
    config = {"tokenizer_class": TOKENIZER_CLASS, **special, "add_bos_token": False, "add_eos_token": False,
              "model_max_length": int(model_max_length), "clean_up_tokenization_spaces": False,
              "padding_side": "right"}
    if chat_template:
        config["chat_template"] = chat_template
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        atomic.write_bytes(os.path.join(out_dir, name), (json.dumps(data, indent=1) + "\n").encode())
    return {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
