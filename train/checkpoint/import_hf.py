"""Import a Hugging Face Llama or SmolLM3 folder as a smoltrain checkpoint (`train ckpt import HF_FOLDER OUT`).

The folder needs config.json (model_type llama or smollm3) and model.safetensors, or sharded safetensors
with model.safetensors.index.json. Configurations this trainer's model cannot express are refused, naming
the field (rope scaling, biases, another activation or model type;
for SmolLM3 also sliding-window attention and a `no_rope_layers` pattern that is not every N-th layer).
SmolLM3's NoPE layers become `model.no_rope_every: N` (its `no_rope_layers`: 1 = RoPE, 0 at layers N, 2N,
...; without the list, `no_rope_layer_interval`, as transformers builds it); SmolLM3 ignores
`pretraining_tp`, so it is not checked there.

The checkpoint is written by the trainer's own save path (`train.checkpoint.import_worker`, in a
subprocess: megatron and the CPU layer stay out of the caller's process) at TP1 PP1, step 0, no
optimizer, so `train eval`, `train ckpt export` and `train launch --init` read it like any other. Its
manifest's `meta.model` is the model config (vocab unpadded: make_vocab_size_divisible_by 1, so the
embedding keeps the folder's rows and export gives them back), `meta.precision` follows the weights'
dtype (bf16 stays bf16, fp32 stays fp32, fp16 becomes fp32). The folder's tokenizer and config files
(tokenizer.json, tokenizer_config.json with its chat_template, chat_template.jinja, special_tokens_map.json,
generation_config.json, config.json) are carried in the checkpoint's `hf/` folder (listed and checksummed
in the manifest), so the model can be fine-tuned and exported back with its tokenizer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from train.checkpoint.layout import CheckpointError

HF_DIR = "hf"  # the carried files inside the checkpoint folder
CARRIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp32"}  # safetensors dtype → precision kept


class ImportError_(CheckpointError):  # noqa: N801 - not the builtin ImportError
    """A folder that cannot be imported; the message names the file or config field."""


def read_config(folder: str) -> dict:
    """Model shape (train.model.gpt.ModelConfig keys) of a HF Llama / SmolLM3 folder; refuses what we cannot
    express."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            c = json.load(f)
    except FileNotFoundError:
        raise ImportError_(f"{path}: missing (not a Hugging Face model folder)") from None

    def refuse(field: str, why: str):
        raise ImportError_(f"{path}: unsupported {field!r}: {why}")

    kind = c.get("model_type")
    if any(a.endswith("ForSequenceClassification") for a in c.get("architectures") or []) and c.get("num_labels", 1) != 1:
        refuse("num_labels", f"{c['num_labels']} (a reward model has one score)")
    if kind not in ("llama", "smollm3"):
        refuse("model_type", f"{kind!r} (only 'llama' and 'smollm3' are supported)")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(c.get(field), int):
            refuse(field, f"missing or not an integer ({c.get(field)!r})")
    if c.get("rope_scaling"):
        refuse("rope_scaling", f"{c['rope_scaling']!r} (only plain RoPE is supported)")
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        refuse("rope_parameters.rope_type", f"{rope['rope_type']!r} (only plain RoPE is supported)")
    for field in ("attention_bias", "mlp_bias"):
        if c.get(field):
            refuse(field, "true (the model has no biases)")
    if c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"{c['hidden_act']!r} (only silu / SwiGLU)")
    if kind == "llama" and (c.get("pretraining_tp") or 1) != 1:
        refuse("pretraining_tp", f"{c['pretraining_tp']}")
    no_rope_every = _no_rope_every(c, refuse) if kind == "smollm3" else 0
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim")
    if head_dim is None and hidden % heads:
        refuse("head_dim", f"missing, and num_attention_heads {heads} does not divide hidden_size {hidden}")
    if heads % kv:
        refuse("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    # transformers' default θ when the config names none: LlamaConfig 10 000, SmolLM3Config 2 000 000
    theta = rope.get("rope_theta", c.get("rope_theta", 2_000_000.0 if kind == "smollm3" else 10000.0))
    return {"preset": "tiny", "hidden_size": hidden, "num_layers": c["num_hidden_layers"], "num_heads": heads,
            "num_kv_heads": kv, "ffn_hidden_size": c["intermediate_size"], "vocab_size": c["vocab_size"],
            "max_position_embeddings": int(c.get("max_position_embeddings") or 2048),
            "rope_theta": float(theta), "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
            "no_rope_every": no_rope_every, "head_dim": None if head_dim in (None, hidden // heads) else int(head_dim),
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            "init_std": float(c.get("initializer_range", 0.02)), "make_vocab_size_divisible_by": 1}


def _no_rope_every(c: dict, refuse) -> int:
    """model.no_rope_every of a SmolLM3 config: N when its NoPE layers are exactly layers N, 2N, ... (1-based),
    0 when every layer uses RoPE; anything else is refused naming `no_rope_layers`."""
    layers = c["num_hidden_layers"]
    if c.get("use_sliding_window") and c.get("sliding_window"):
        refuse("use_sliding_window", "true (sliding-window attention is not supported)")
    types = c.get("layer_types")
    if types and any(t != "full_attention" for t in types[:layers]):
        refuse("layer_types", f"{sorted(set(types))} (only full_attention is supported)")
    pattern = c.get("no_rope_layers")
    if pattern is None:  # transformers builds it from the interval
        interval = c.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            refuse("no_rope_layer_interval", f"{interval!r} (a positive integer expected)")
        return interval if interval <= layers else 0
    if not isinstance(pattern, list) or len(pattern) < layers or any(p not in (0, 1) for p in pattern):
        refuse("no_rope_layers", f"{pattern!r} (one 0 or 1 per layer, {layers} layers)")
    pattern = pattern[:layers]  # transformers reads the first num_hidden_layers entries
    nope = [i for i, r in enumerate(pattern) if not r]
    if not nope:
        return 0
    every = nope[0] + 1
    if pattern != [int((i + 1) % every != 0) for i in range(layers)]:
        refuse("no_rope_layers", f"NoPE at layers {[i + 1 for i in nope]} (1-based) is not every N-th layer, "
                                 "which is all model.no_rope_every can express")
    return every


def weight_files(folder: str) -> list[str]:
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        raise ImportError_(f"{folder}: no model.safetensors and no model.safetensors.index.json")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    outside = [s for s in shards if os.path.basename(s) != s or not s.endswith(".safetensors")]
    if outside:  # the index names the files to read: only safetensors files inside the folder
        raise ImportError_(f"{index}: weight_map names {outside[0]!r}, not a .safetensors file in {folder}")
    missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        raise ImportError_(f"{index}: shard(s) missing: {', '.join(missing)}")
    return [os.path.join(folder, s) for s in shards]


def load_tensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in weight_files(folder):
        out.update(load_file(path))
    return out


def megatron_params(hf: dict, shape: dict, names: list[str]) -> dict:
    """HF tensors → this (TP1 PP1) megatron model's parameters, by parameter name. Both the local spec's
    names (input_layernorm, pre_mlp_layernorm) and Transformer Engine's fused ones are understood.
    Inverse of export_hf.to_llama: q/k/v interleaved per query group into linear_qkv, [gate; up] into fc1."""
    import torch

    heads, kv, hidden = shape["num_heads"], shape["num_kv_heads"], shape["hidden_size"]
    hd, per = shape.get("head_dim") or hidden // heads, heads // kv
    used = set()

    def get(name):
        if name not in hf:
            raise ImportError_(f"tensor {name!r} is missing from the safetensors files")
        used.add(name)
        return hf[name]

    def one(name: str):
        if name == "embedding.word_embeddings.weight":
            return get("model.embed_tokens.weight")
        if name == "decoder.final_layernorm.weight":
            return get("model.norm.weight")
        if name == "output_layer.weight":  # a reward model (score.weight) has no LM head: the slot stays unused
            return get("lm_head.weight") if "lm_head.weight" in hf or "score.weight" not in hf else \
                hf["model.embed_tokens.weight"].clone()
        if name == "reward_head.weight":  # LlamaForSequenceClassification's score (train.model.heads)
            return get("score.weight")
        parts = name.split(".")
        if parts[:2] != ["decoder", "layers"]:
            raise ImportError_(f"no Hugging Face tensor maps to parameter {name!r}")
        p, rest = f"model.layers.{parts[2]}.", ".".join(parts[3:])
        if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
            return get(p + "input_layernorm.weight")
        if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
            return get(p + "post_attention_layernorm.weight")
        if rest == "self_attention.linear_qkv.weight":
            q = get(p + "self_attn.q_proj.weight").reshape(kv, per * hd, hidden)
            k = get(p + "self_attn.k_proj.weight").reshape(kv, hd, hidden)
            v = get(p + "self_attn.v_proj.weight").reshape(kv, hd, hidden)
            return torch.cat([q, k, v], dim=1).reshape(kv * (per + 2) * hd, hidden)
        if rest == "self_attention.linear_proj.weight":
            return get(p + "self_attn.o_proj.weight")
        if rest == "mlp.linear_fc1.weight":
            return torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        if rest == "mlp.linear_fc2.weight":
            return get(p + "mlp.down_proj.weight")
        raise ImportError_(f"no Hugging Face tensor maps to parameter {name!r}")

    out = {n: one(n) for n in names}
    unused = sorted(k for k in set(hf) - used if not k.endswith("rotary_emb.inv_freq")
                    and not (k == "lm_head.weight" and shape["tie_embeddings"]))
    if unused:
        raise ImportError_(f"tensors the model has no place for: {', '.join(unused[:8])}")
    return out


def import_folder(folder: str, out_root: str, timeout: float | None = None) -> str:
    """Convert `folder` into a checkpoint under `out_root` (OUT_ROOT/step_00000000, `latest`); returns its
    path. The shape is checked here first, so a refused folder fails fast, without starting megatron."""
    folder, out_root = os.path.abspath(folder), os.path.abspath(out_root)
    read_config(folder)
    weight_files(folder)
    if os.path.isdir(out_root) and any(n.startswith("step_") for n in os.listdir(out_root)):
        raise ImportError_(f"{out_root}: already holds checkpoints; give an empty or new folder")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    r = subprocess.run([sys.executable, "-m", "train.checkpoint.import_worker", folder, out_root],
                       env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise ImportError_(f"import of {folder} failed:\n{tail}")
    return r.stdout.strip().splitlines()[-1]


def dtype_precision(hf: dict) -> tuple[str, str]:
    """(torch dtype name of the checkpoint's weights, precision recorded in meta)."""
    dtypes = {str(t.dtype).removeprefix("torch.") for t in hf.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        raise ImportError_(f"weights have dtype(s) {sorted(dtypes)}; one of float32, bfloat16, float16 expected")
    d = next(iter(dtypes))
    return ("bfloat16" if d == "bfloat16" else "float32"), _DTYPES[d]
