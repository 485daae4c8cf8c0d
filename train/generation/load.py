"""A model to generate with, from a checkpoint (any layout, full or incremental) or a Hugging Face folder:
a transformers model in float32 eval mode, its tokenizer, chat template and EOS ids.

A checkpoint becomes a transformers Llama model (SmolLM3 when it has NoPE layers) in memory through the
same name mapping as the HF export (`export_hf.llama_weights`). Where the pieces come from:
- tokenizer: the HF folder's; an imported checkpoint's carried `hf/` files; else the dataset tokenizer the
  checkpoint recorded (`meta.tokenizer`), with the dataset's EOS;
- chat template: the HF folder's / carried tokenizer's; else the dataset manifest's `chat_template`
  (None when neither has one: callers fall back to storage.chat's built-in ChatML);
- EOS ids: the folder's generation_config.json and tokenizer EOS, or the dataset's EOS.
Remote code is never run (`trust_remote_code` stays off): the architectures are transformers' own.
"""
from __future__ import annotations

import os
from typing import NamedTuple


class GenerateError(RuntimeError):
    """A model or tokenizer that cannot be used; the message says why."""


class Loaded(NamedTuple):
    model: object          # transformers PreTrainedModel, float32, eval mode
    tokenizer: object      # transformers PreTrainedTokenizerFast
    chat_template: str | None
    eos_ids: list[int]


def load_hf_model(folder: str):
    """transformers' causal LM of a Hugging Face folder in float32 eval mode. A folder may come from
    anyone, so its weights are read from safetensors only (a pytorch_model.bin is a pickle, which can run
    code) and its own Python code (config.json's auto_map) is never run (trust_remote_code=False)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
        raise FileNotFoundError(f"{folder}: no model.safetensors (or model.safetensors.index.json); only safetensors "
                                "weights are read, never pickled ones such as pytorch_model.bin")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True,
                                                trust_remote_code=False).eval()


def hf_model(config: dict, weights: dict):
    """A transformers causal LM from an export config dict and Llama-named float tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in config.items() if k not in ("smoltrain_checkpoint", "torch_dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"} or (missing and not config["tie_word_embeddings"]):
        raise GenerateError(f"weights do not fit the Llama model (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    return model.eval()


def checkpoint_tokenizer(path: str, manifest: dict):
    """(tokenizer, chat template, EOS ids) of a checkpoint: carried HF files, else its dataset's tokenizer."""
    from train.checkpoint.export_hf import carried_dir

    carried = carried_dir(path, manifest)
    if carried and os.path.isfile(os.path.join(carried, "tokenizer.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(carried, trust_remote_code=False)
        return tok, tok.chat_template, eos_ids(carried, tok)
    url = (manifest.get("meta") or {}).get("tokenizer")
    if not url:
        raise GenerateError(f"{path}: no tokenizer known (the checkpoint records no dataset tokenizer and "
                            "carries none); export it with --tokenizer and generate from the HF folder")
    return dataset_tokenizer(url)


def dataset_tokenizer(url: str):
    """(tokenizer, chat template, EOS ids) of a dataset's tokenizer.json (EOS and template from its manifest)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from storage.fs import read_bytes
    from train.checkpoint.hf_tokenizer import dataset_chat_template, resolve_eos

    raw = read_bytes(url)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(raw.decode()))
    eos = resolve_eos(raw, url)
    if eos:
        tok.eos_token = tok.pad_token = eos[0]
    return tok, dataset_chat_template(url), [eos[1]] if eos else []


def tokenizer_for(tokenizer_path: str):
    """(tokenizer, chat template, EOS ids) for a tokenizer.json: the HF tokenizer folder it sits in (an
    imported checkpoint's carried files), else a dataset's tokenizer (its manifest's EOS and template)."""
    folder = os.path.dirname(os.path.abspath(tokenizer_path)) if "://" not in tokenizer_path else ""
    if folder and os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        return tok, tok.chat_template, eos_ids(folder, tok)
    return dataset_tokenizer(tokenizer_path)


def eos_ids(folder: str, tok) -> list[int]:
    from transformers import GenerationConfig

    ids = []
    try:
        e = GenerationConfig.from_pretrained(folder).eos_token_id
        ids = list(e) if isinstance(e, (list, tuple)) else ([e] if e is not None else [])
    except OSError:
        pass
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


def is_hf_folder(path: str) -> bool:
    p = os.path.abspath(path)
    return os.path.isfile(os.path.join(p, "config.json")) and not os.path.isfile(os.path.join(p, "manifest.json"))


def load(path: str) -> Loaded:
    """The model of a checkpoint (a step_… folder, or a run dir / checkpoints folder: its newest) or HF folder."""
    p = os.path.abspath(path)
    if is_hf_folder(p):
        from transformers import AutoTokenizer

        model = load_hf_model(p)  # safetensors only, never the folder's own code
        tok = AutoTokenizer.from_pretrained(p, trust_remote_code=False)
        return Loaded(model, tok, tok.chat_template, eos_ids(p, tok))
    from storage.config import ConfigError
    from train.checkpoint.export_hf import llama_weights
    from train.checkpoint.layout import find_checkpoints

    try:
        ckpt = find_checkpoints(p, every=False)[0]
    except (ConfigError, FileNotFoundError) as e:
        raise GenerateError(f"{path}: neither a Hugging Face folder (config.json) nor a checkpoint ({e})") from None
    weights, config, manifest = llama_weights(ckpt)
    try:
        model = hf_model(config, weights)
    except GenerateError as e:
        raise GenerateError(f"{ckpt}: {e}") from None
    tok, template, eos = checkpoint_tokenizer(ckpt, manifest)
    return Loaded(model, tok, template, eos)
