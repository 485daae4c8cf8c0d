"""A tiny random-init Llama as a smoltrain checkpoint (the Megatron tensor layout): shared by the train
tests through the `tiny_hf` fixture (tests/train/conftest.py)."""
from __future__ import annotations

import os

import torch

EOS = "<|endoftext|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, vocab_size=1024,
             max_position_embeddings=128, rope_theta=10000.0, norm_eps=1e-5)


def megatron_tensors(model) -> dict[str, torch.Tensor]:
    """The inverse of export_hf.to_llama: HF Llama weights → stacked Megatron keys."""
    sd, cfg = model.state_dict(), model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd, per = cfg.hidden_size // heads, heads // kv
    layers = range(cfg.num_hidden_layers)

    def stack(fn):
        return torch.stack([fn(f"model.layers.{i}.") for i in layers])

    def qkv(p):
        q = sd[p + "self_attn.q_proj.weight"].reshape(kv, per * hd, -1)
        k = sd[p + "self_attn.k_proj.weight"].reshape(kv, hd, -1)
        v = sd[p + "self_attn.v_proj.weight"].reshape(kv, hd, -1)
        return torch.cat([q, k, v], dim=1).reshape(kv * (per + 2) * hd, -1)

    return {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
        "decoder.layers.self_attention.linear_qkv.weight": stack(qkv),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stack(lambda p: sd[p + "input_layernorm.weight"]),
        "decoder.layers.self_attention.linear_proj.weight": stack(lambda p: sd[p + "self_attn.o_proj.weight"]),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": stack(lambda p: sd[p + "post_attention_layernorm.weight"]),
        "decoder.layers.mlp.linear_fc1.weight": stack(lambda p: torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                                           sd[p + "mlp.up_proj.weight"]])),
        "decoder.layers.mlp.linear_fc2.weight": stack(lambda p: sd[p + "mlp.down_proj.weight"]),
    }


def write_checkpoint(root: str, model, meta: dict) -> str:
    from train.checkpoint import layout
    from train.checkpoint.incremental import Piece, write_raw

    tmp = layout.tmp_dir_for(root, 1)
    os.makedirs(tmp)
    pieces = [Piece(k, tuple(t.shape), (0,) * t.dim(), t.detach().clone().contiguous())
              for k, t in megatron_tensors(model).items()]
    stats = write_raw(tmp, 0, pieces)
    layout.commit(tmp, root, 1, "full", None, {"meta": meta}, hashed=stats["files"])
    return os.path.join(root, layout.ckpt_name(1))


def random_llama(tokenizer_vocab: int):
    """The tiny Llama (SHAPE), random-init with seed 0, in eval mode; embedding rows past the tokenizer's
    `tokenizer_vocab` (vocabulary padding) are zero: never trained, in a real model they score far below
    every token, and zero rows make them lose here too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"],
                      intermediate_size=SHAPE["ffn_hidden_size"], num_hidden_layers=SHAPE["num_layers"],
                      num_attention_heads=SHAPE["num_heads"], num_key_value_heads=SHAPE["num_kv_heads"],
                      max_position_embeddings=SHAPE["max_position_embeddings"], rope_theta=SHAPE["rope_theta"],
                      rms_norm_eps=SHAPE["norm_eps"], tie_word_embeddings=True, initializer_range=0.1)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[tokenizer_vocab:] = 0.0
    return model
