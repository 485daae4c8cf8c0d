"""`train generate`: talk to a checkpoint or a Hugging Face folder (chat template, then greedy or sampled
generation until the end-of-turn token or EOS).

One code path for both: a checkpoint becomes a transformers Llama model (SmolLM3 when it has NoPE layers)
in memory through the same name mapping as the HF export (`export_hf.llama_weights`), and transformers'
`generate` does the rest (KV cache, sampling). Where the pieces come from:

- tokenizer: the HF folder's; an imported checkpoint's carried `hf/` files; else the dataset tokenizer the
  checkpoint recorded (`meta.tokenizer`), with the dataset's EOS;
- chat template: the HF folder's / carried tokenizer's; else the dataset manifest's `chat_template`; else
  built-in ChatML (datapipe.chat's when that module exists);
- stop tokens: EOS, plus the template's end-of-turn token (the added token that follows an assistant
  message in the rendered template, e.g. `<|im_end|>`).
Vocabulary padding rows (ids the tokenizer does not have) are never generated.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class GenerateError(RuntimeError):
    """A model or tokenizer that cannot be used; the message says why."""


@dataclass
class Generation:
    text: str                                   # the reply, decoded without special tokens
    prompt_text: str                            # what was encoded (template rendered)
    prompt_ids: list[int]
    new_ids: list[int]                          # generated ids, the stop token included when one was hit
    stop_ids: list[int] = field(default_factory=list)


def builtin_template() -> str:
    try:
        from datapipe.chat import BUILTIN_TEMPLATES
        return BUILTIN_TEMPLATES["chatml"]
    except (ImportError, KeyError):
        return CHATML


def render(template: str, messages: list[dict], tok) -> str:
    """The prompt text with the generation prompt: datapipe.chat.render (as SFT data is rendered) when that
    module exists, else transformers' Jinja rendering."""
    try:
        from datapipe.chat import render as dp_render
    except ImportError:
        dp_render = None
    if dp_render is not None:
        return dp_render(template, messages, add_generation_prompt=True)[0]
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


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


def _from_checkpoint(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from storage.fs import read_bytes
    from train.checkpoint.export_hf import carried_dir, llama_weights
    from train.checkpoint.hf_tokenizer import dataset_chat_template, resolve_eos

    hf, config, m = llama_weights(path)
    config = {k: v for k, v in config.items() if k not in ("smoltrain_checkpoint", "torch_dtype")}
    # the export's config: Llama, or SmolLM3 when the model has NoPE layers
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in hf.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"} or (missing and not config["tie_word_embeddings"]):
        raise GenerateError(f"{path}: weights do not fit the Llama model (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    carried = carried_dir(path, m)
    if carried and os.path.isfile(os.path.join(carried, "tokenizer.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(carried, trust_remote_code=False)
        return model, tok, tok.chat_template, _eos_ids(carried, tok)
    url = (m.get("meta") or {}).get("tokenizer")
    if not url:
        raise GenerateError(f"{path}: no tokenizer known (the checkpoint records no dataset tokenizer and "
                            "carries none); export it with --tokenizer and generate from the HF folder")
    raw = read_bytes(url)
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(raw.decode()))
    eos = resolve_eos(raw, url)
    return model, tok, dataset_chat_template(url), [eos[1]] if eos else []


def _eos_ids(folder: str, tok) -> list[int]:
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


def load(path: str):
    """(model in float32 eval mode, tokenizer, chat template or None, EOS ids) of a checkpoint or HF folder."""
    p = os.path.abspath(path)
    if os.path.isfile(os.path.join(p, "config.json")) and not os.path.isfile(os.path.join(p, "manifest.json")):
        from transformers import AutoTokenizer

        from train.eval.hf import load_hf_model

        model = load_hf_model(p)  # safetensors only, never the folder's own code
        tok = AutoTokenizer.from_pretrained(p, trust_remote_code=False)
        out = model, tok, tok.chat_template, _eos_ids(p, tok)
    else:
        from storage.config import ConfigError
        from train.eval.results import checkpoints

        try:
            ckpt = checkpoints(p, every=False)[0]
        except (ConfigError, FileNotFoundError) as e:
            raise GenerateError(f"{path}: neither a Hugging Face folder (config.json) nor a checkpoint ({e})") from None
        out = _from_checkpoint(ckpt)
    out[0].eval()
    return out


def generate(path: str, prompt: str, *, system: str | None = None, chat: bool = True, max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, loaded=None) -> Generation:
    """Reply to `prompt` (a user message; with chat=False the raw text). Greedy when temperature is 0."""
    import torch
    from transformers import GenerationConfig

    model, tok, template, eos = loaded or load(path)
    stop = list(eos)
    if chat:
        template = template or builtin_template()
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = render(template, messages, tok)
        stop += [i for i in end_of_turn_ids(template, tok) if i not in stop]
    else:
        text = prompt
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise GenerateError("the prompt encodes to no tokens")
    vocab = model.config.vocab_size
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=stop or None, pad_token_id=stop[0] if stop else 0,
              suppress_tokens=list(range(len(tok), vocab)) or None)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p)
        torch.manual_seed(seed)
    else:
        kw.update(do_sample=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(**kw))
    new = out[0, len(ids):].tolist()
    body = new[:-1] if new and new[-1] in stop else new
    return Generation(tok.decode(body, skip_special_tokens=True), text, ids, new, stop)
