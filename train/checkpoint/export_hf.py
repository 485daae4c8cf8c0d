"""Export a checkpoint (full or incremental, any TP/PP layout) to a Hugging Face Llama folder (a SmolLM3 one
when the model has NoPE layers, `model.no_rope_every`; a LlamaForSequenceClassification one for a reward
model, whose checkpoint holds `reward_head.weight`):
model.safetensors, config.json, generation_config.json, tokenizer.json, and (when the EOS token is known:
see train.checkpoint.hf_tokenizer) tokenizer_config.json and special_tokens_map.json, loadable by
`transformers.AutoModelForCausalLM / AutoTokenizer.from_pretrained` and lm-eval's HF backend.

Weights are read as whole (unsharded) tensors (raw full checkpoints: assembled from the ranks' pieces;
torch_dist ones: megatron's `load_plain_tensors`), deltas applied for incremental checkpoints, then
renamed/split into Llama's layout:
  linear_qkv  [groups × (q_per_group + 2) × head_dim, h]  →  q_proj, k_proj, v_proj
  linear_fc1  [gate; up]                                   →  gate_proj, up_proj
The padded vocabulary is kept (vocab_size in config.json is the padded size), so logits line up with ours.
SmolLM3 has Llama's tensor names; its config.json adds `no_rope_layers` (1 = RoPE, 0 = NoPE layer: every
`no_rope_layer_interval`-th) and `model_type: smollm3` (transformers' SmolLM3ForCausalLM).
A checkpoint made by `train ckpt import` gets its carried tokenizer files back (import → export gives the
original tensors, names and dtypes).
"""
from __future__ import annotations

import json
import os

import fsspec
import torch

from train.checkpoint import layout, safe_load
from train.checkpoint.incremental import RAW_DIR, PieceSet


def _raw_tensors(path: str) -> dict[str, torch.Tensor]:
    """Whole model tensors of a raw full checkpoint, assembled from every rank's pieces."""
    pieces = PieceSet(path, RAW_DIR)
    out = {}
    for key in pieces.keys():
        if key.startswith("optimizer"):
            continue
        e = pieces.entries(key)[0]
        t = torch.empty(e["global_shape"], dtype=getattr(torch, e["dtype"]))
        pieces.apply(key, (0,) * t.dim(), t)
        if pieces.elements != t.numel():
            raise layout.CheckpointError(f"{path}: {key}: pieces cover {pieces.elements} of {t.numel()} elements")
        out[key] = t
    return out


def _plain_tensors(path: str) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if os.path.isdir(os.path.join(path, RAW_DIR)):
        return _raw_tensors(path)

    created = False
    if not dist.is_initialized():  # megatron's loader asks for a rank even when reading everything
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    safe_load.install()  # torch_dist's metadata and bytes items: no code from the checkpoint
    try:
        sd = dist_checkpointing.load_plain_tensors(path)
    finally:
        if created:
            dist.destroy_process_group()
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer")}


def load_model_tensors(ckpt_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Whole model tensors of a checkpoint (megatron key → tensor) and its manifest."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    m = layout.read_manifest(fsspec.filesystem("file"), ckpt_dir)
    base_dir = os.path.join(os.path.dirname(ckpt_dir), m["base"]) if m.get("base") else ckpt_dir
    tensors = _plain_tensors(base_dir)
    if m["kind"] == "incremental":
        deltas = PieceSet(ckpt_dir)
        for k, t in tensors.items():
            deltas.apply(k, (0,) * t.dim(), t)
    return tensors, m


def _pick(t: dict, *names: str) -> torch.Tensor:
    for n in names:
        if n in t:
            return t[n]
    raise KeyError(f"none of {names} in checkpoint (keys: {', '.join(sorted(t)[:12])} ...)")


def to_llama(t: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"],
           "model.norm.weight": t["decoder.final_layernorm.weight"]}
    if "reward_head.weight" in t:  # a reward model: transformers' sequence classification (train.model.heads)
        out["score.weight"] = t["reward_head.weight"]
    elif "output_layer.weight" in t:
        out["lm_head.weight"] = t["output_layer.weight"]
    qkv = t["decoder.layers.self_attention.linear_qkv.weight"]
    layers, rows, hidden = qkv.shape
    per_group = heads // kv_heads
    hd = rows // (kv_heads * (per_group + 2))  # the head size (may differ from hidden / heads: model.head_dim)
    ln1 = _pick(t, "decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.input_layernorm.weight")
    ln2 = _pick(t, "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.pre_mlp_layernorm.weight")
    fc1 = t["decoder.layers.mlp.linear_fc1.weight"]
    ffn = fc1.shape[1] // 2
    for i in range(layers):
        p = f"model.layers.{i}."
        g = qkv[i].reshape(kv_heads, (per_group + 2) * hd, hidden)
        out[p + "self_attn.q_proj.weight"] = g[:, : per_group * hd].reshape(heads * hd, hidden)
        out[p + "self_attn.k_proj.weight"] = g[:, per_group * hd: (per_group + 1) * hd].reshape(kv_heads * hd, hidden)
        out[p + "self_attn.v_proj.weight"] = g[:, (per_group + 1) * hd:].reshape(kv_heads * hd, hidden)
        out[p + "self_attn.o_proj.weight"] = t["decoder.layers.self_attention.linear_proj.weight"][i]
        out[p + "input_layernorm.weight"] = ln1[i]
        out[p + "post_attention_layernorm.weight"] = ln2[i]
        out[p + "mlp.gate_proj.weight"] = fc1[i, :ffn]
        out[p + "mlp.up_proj.weight"] = fc1[i, ffn:]
        out[p + "mlp.down_proj.weight"] = t["decoder.layers.mlp.linear_fc2.weight"][i]
    return {k: v.contiguous().clone() for k, v in out.items()}


def model_shape(manifest: dict, overrides: dict | None = None) -> dict:
    """Model hyper-parameters from the manifest's meta.model (a train.model.gpt.ModelConfig mapping)."""
    from train.model.gpt import ModelConfig

    meta = dict((manifest.get("meta") or {}).get("model") or {})
    meta.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = {f for f in ModelConfig.__dataclass_fields__}
    cfg = ModelConfig(**{k: v for k, v in meta.items() if k in known}).resolved()
    if cfg.moe.enabled:  # a dense Llama folder would silently drop the experts
        from train.checkpoint.errors import CheckpointError

        raise CheckpointError(f"a mixture-of-experts checkpoint ({cfg.moe.num_experts} experts): Hugging Face export, "
                              "generation from it and pruning are not built for MoE yet")
    return cfg.__dict__


def hf_config(hf: dict[str, torch.Tensor], s: dict, m: dict) -> dict:
    """config.json of the Llama folder for Llama-named tensors `hf`, model shape `s`, manifest `m`; a SmolLM3
    config when `s` has NoPE layers (no_rope_every)."""
    emb = hf["model.embed_tokens.weight"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": emb.shape[1], "intermediate_size": hf["model.layers.0.mlp.gate_proj.weight"].shape[0],
        "num_hidden_layers": sum(1 for k in hf if k.endswith("q_proj.weight")),
        "num_attention_heads": s["num_heads"], "num_key_value_heads": s["num_kv_heads"],
        "head_dim": hf["model.layers.0.self_attn.q_proj.weight"].shape[0] // s["num_heads"], "vocab_size": emb.shape[0],
        "max_position_embeddings": s["max_position_embeddings"], "rms_norm_eps": s["norm_eps"],
        "rope_theta": float(s["rope_theta"]), "tie_word_embeddings": "lm_head.weight" not in hf,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": str(emb.dtype).removeprefix("torch."),
        "smoltrain_checkpoint": {"name": m["name"], "step": m["step"], "kind": m["kind"]},
    }
    if "score.weight" in hf:  # a reward model: one score, read at the last token that is not padding
        config.update({"architectures": ["LlamaForSequenceClassification"], "num_labels": 1,
                       "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
                       "tie_word_embeddings": bool(s.get("tie_embeddings", True))})
    every = int(s.get("no_rope_every") or 0)
    if every:
        layers = config["num_hidden_layers"]
        config.update({
            "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
            "no_rope_layer_interval": every, "no_rope_layers": [int((i + 1) % every != 0) for i in range(layers)],
            "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * layers,
            # SmolLM3Config's defaults are SmolLM3's token ids (pad 128004): unset unless a tokenizer gives them
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        })
    return config


def llama_weights(ckpt_dir: str, overrides: dict | None = None) -> tuple[dict, dict, dict]:
    """(Llama-named tensors, config.json dict, manifest) of a checkpoint: what `export` writes, in memory
    (`train generate` builds a transformers model from it). The config's model_type is `llama`, or
    `smollm3` for a model with NoPE layers (same tensor names)."""
    tensors, m = load_model_tensors(ckpt_dir)
    s = model_shape(m, overrides)
    hf = to_llama(tensors, s["num_heads"], s["num_kv_heads"])
    return hf, hf_config(hf, s, m), m


def carried_dir(ckpt_dir: str, manifest: dict) -> str | None:
    """The `hf/` folder an imported checkpoint carries (tokenizer and config files), if any."""
    sub = ((manifest.get("meta") or {}).get("hf") or {}).get("dir")
    path = os.path.join(os.path.abspath(ckpt_dir), sub) if sub else None
    return path if path and os.path.isdir(path) else None


def _copy_carried(src: str, out_dir: str) -> dict:
    """Tokenizer files of an imported checkpoint, verbatim; returns the special token ids of its config."""
    import shutil

    from train.checkpoint.import_hf import CARRIED

    for name in CARRIED:
        if name != "config.json" and os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    try:
        with open(os.path.join(src, "config.json")) as f:
            orig = json.load(f)
    except FileNotFoundError:
        return {}
    return {k: orig[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if orig.get(k) is not None}


def export(ckpt_dir: str, out_dir: str, tokenizer: str | None = None, overrides: dict | None = None,
           eos_token: str | None = None, card: str | None = None) -> dict:
    """Write the HF folder; returns the config written. The EOS token (also BOS and padding) is `eos_token`,
    else the EOS of the dataset the tokenizer belongs to, else the tokenizer's only special token.
    An imported checkpoint (train ckpt import) without a recorded dataset tokenizer gets its carried
    tokenizer files back verbatim. The chat template of the tokenizer's dataset (manifest `chat_template`),
    when known, goes into tokenizer_config.json. `card`: README.md's text (train.checkpoint.model_card)."""
    from safetensors.torch import save_file

    from storage import atomic
    from storage.fs import read_bytes
    from train.checkpoint.hf_tokenizer import dataset_chat_template, resolve_eos, write_tokenizer_files

    hf, config, m = llama_weights(ckpt_dir, overrides)
    s = model_shape(m, overrides)
    tok = tokenizer or (m.get("meta") or {}).get("tokenizer")
    carried = carried_dir(ckpt_dir, m)
    with atomic.atomic_dir(out_dir) as out:  # the folder appears complete (storage.atomic)
        special = {}
        if tok:
            tok_bytes = read_bytes(tok)
            special = write_tokenizer_files(out, tok_bytes, resolve_eos(tok_bytes, tok, eos_token),
                                            s["max_position_embeddings"], chat_template=dataset_chat_template(tok))
        elif carried and eos_token is None:
            special = _copy_carried(carried, out)
        elif eos_token is not None:
            raise ValueError("an EOS token was given but there is no tokenizer to export (pass --tokenizer)")
        config.update(special)
        if "score.weight" in hf and tok:
            # transformers finds a sequence's last token by pad_token_id: an id no text encodes to (the first
            # padding row of the embedding), so that a sequence ending with EOS is scored at its EOS, as ours
            from tokenizers import Tokenizer

            n = Tokenizer.from_str(tok_bytes.decode()).get_vocab_size(with_added_tokens=True)
            if n < hf["model.embed_tokens.weight"].shape[0]:
                config["pad_token_id"] = n
        save_file(hf, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        if card is not None:
            with open(os.path.join(out, "README.md"), "w") as f:
                f.write(card)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        if not (carried and not tok and os.path.isfile(os.path.join(carried, "generation_config.json"))):
            with open(os.path.join(out, "generation_config.json"), "w") as f:
                json.dump({"_from_model_config": True, **special}, f, indent=1)
    return config
