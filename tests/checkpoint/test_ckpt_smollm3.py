"""SmolLM3 (NoPE layers, `model.no_rope_every`) through `train ckpt export` and `train ckpt import`.

A reduced-depth SmolLM3-3B config (the `3b` preset: θ 5e6, RMSNorm eps 1e-6, GQA 4:1, NoPE every 4th
layer; hidden 64, 8 layers) is built by megatron in this process, written as a raw checkpoint, exported, and
loaded by transformers' SmolLM3ForCausalLM: logits equal ours within 1e-4, and the same folder read with
RoPE in every layer equals our all-RoPE model instead (so the match depends on the NoPE layers). Read
back by the import, the folder gives no_rope_every 4 and every parameter bit for bit; irregular NoPE
patterns are refused naming the field."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from testutil import megatron_one_rank, require

require("transformers")

SHAPE = dict(preset="3b", hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=1, ffn_hidden_size=128,
             vocab_size=384, max_position_embeddings=256, init_std=0.1)
TOKENS = (torch.arange(40).reshape(2, 20) * 37 % 384).long()


@pytest.fixture
def one_rank(tmp_path):
    with megatron_one_rank(tmp_path):
        yield


def _ours(cfg):
    """(megatron model, its logits for TOKENS)."""
    from train.model.gpt import build_model

    (m,) = build_model(cfg, seed=5)
    m.eval()
    with torch.no_grad():
        return m, m(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS), None)


def _write_checkpoint(root: str, model, cfg) -> str:
    """The model's parameters stacked over layers (the checkpoint layout), as a raw full checkpoint."""
    from train.checkpoint import layout
    from train.checkpoint.incremental import Piece, write_raw

    stacked: dict[str, list] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:2] + parts[3:]) if parts[:2] == ["decoder", "layers"] else name
        stacked.setdefault(key, []).append(p.detach())
    tensors = {k: torch.stack(v) if k.startswith("decoder.layers.") else v[0] for k, v in stacked.items()}
    tmp = layout.tmp_dir_for(root, 1)
    os.makedirs(tmp)
    pieces = [Piece(k, tuple(t.shape), (0,) * t.dim(), t.clone().contiguous()) for k, t in tensors.items()]
    stats = write_raw(tmp, 0, pieces)
    layout.commit(tmp, root, 1, "full", None, {"meta": {"model": dataclasses.asdict(cfg.resolved())}},
                  hashed=stats["files"])
    return os.path.join(root, layout.ckpt_name(1))


def test_nope_export_matches_transformers_smollm3_and_reads_back(one_rank, tmp_path):
    from transformers import AutoModelForCausalLM

    from train.checkpoint.export_hf import export
    from train.checkpoint.import_hf import load_tensors, megatron_params, read_config
    from train.model.gpt import ModelConfig

    cfg = ModelConfig(**SHAPE)
    assert cfg.resolved().no_rope_every == 4  # the 3b preset's, as SmolLM3
    model, ours = _ours(cfg)
    _, all_rope = _ours(dataclasses.replace(cfg, no_rope_every=0))  # same weights: NoPE has no parameters
    assert (ours - all_rope).abs().max().item() > 1e-2

    out = tmp_path / "hf"
    config = export(_write_checkpoint(str(tmp_path / "ckpt"), model, cfg), str(out))
    assert config["model_type"] == "smollm3" and config["architectures"] == ["SmolLM3ForCausalLM"]
    assert config["no_rope_layers"] == [1, 1, 1, 0, 1, 1, 1, 0] and config["no_rope_layer_interval"] == 4
    assert json.loads((out / "config.json").read_text())["no_rope_layers"] == config["no_rope_layers"]

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == "SmolLM3ForCausalLM"
    assert hf.config.rope_parameters["rope_theta"] == 5e6 and hf.config.rms_norm_eps == 1e-6
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max().item() < 1e-4
    # the same weights with RoPE in every layer are our all-RoPE model, not ours
    hf_rope = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, no_rope_layers=[1] * 8).eval()
    with torch.no_grad():
        theirs_rope = hf_rope(TOKENS).logits
    assert (theirs_rope - all_rope).abs().max().item() < 1e-4 < (theirs_rope - ours).abs().max().item()

    # import: the shape it records has the NoPE interval, and the folder's tensors map back onto every
    # parameter of our model bit for bit (the checkpoint writer behind it is the Llama import's, tested there)
    shape = read_config(str(out))
    assert shape["no_rope_every"] == 4 and shape["num_layers"] == 8 and shape["rope_theta"] == 5e6
    rebuilt = ModelConfig(**shape)
    assert rebuilt.no_rope_layers() == cfg.no_rope_layers() and rebuilt.padded_vocab_size() == 384
    params = dict(model.named_parameters())
    back = megatron_params(load_tensors(str(out)), shape, list(params))
    assert all(torch.equal(back[n], p) for n, p in params.items())


def test_import_reads_and_refuses_nope_patterns(tmp_path):
    from train.checkpoint.import_hf import ImportError_, read_config

    base = {"model_type": "smollm3", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 384, "rope_theta": 5e6,
            "pretraining_tp": 2}  # SmolLM3-3B's config says 2; its modelling code ignores it

    def read(**change):
        (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
        return read_config(str(tmp_path))

    assert read(no_rope_layers=[1, 1, 1, 0, 1, 1, 1, 0])["no_rope_every"] == 4
    assert read(no_rope_layers=[1, 1, 1, 0, 1, 1, 1, 0, 1, 1])["no_rope_every"] == 4  # longer list: first 8
    assert read()["no_rope_every"] == 4  # no list: transformers' default interval, 4
    assert read(no_rope_layer_interval=2)["no_rope_every"] == 2
    assert read(no_rope_layers=[1] * 8)["no_rope_every"] == 0
    assert read(model_type="llama", pretraining_tp=1)["no_rope_every"] == 0
    for field, change in {"no_rope_layers": {"no_rope_layers": [1, 1, 0, 1, 1, 1, 0, 1]},
                          "use_sliding_window": {"use_sliding_window": True, "sliding_window": 16}}.items():
        with pytest.raises(ImportError_, match=f"unsupported '{field}'"):
            read(**change)
    with pytest.raises(ImportError_, match="unsupported 'no_rope_layers'.*layers \\[3, 7\\]"):
        read(no_rope_layers=[1, 1, 0, 1, 1, 1, 0, 1])
