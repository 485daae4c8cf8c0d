"""A checkpoint exported by `train ckpt export` is a complete Hugging Face folder (tokenizer config with
EOS / BOS / padding, generation config) that transformers and lm-eval's HF backend load, and `score_hf`
(train eval --hf) gives the same per-candidate log-likelihoods and accuracies as lm-evaluation-harness.

The model is a small random-init Llama built by transformers, written as a raw smoltrain checkpoint (the
Megatron tensor layout) next to a dataset manifest and a BPE tokenizer trained on ../shared/corpora, then
exported through the CLI; no training, no download (lm-eval runs offline)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from testutil import read_corpus, require

require("transformers")
require("lm_eval")

EOS = "<|endoftext|>"
SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, vocab_size=1024,
             max_position_embeddings=128, rope_theta=10000.0, norm_eps=1e-5)
TASKS = ("arc_easy", "piqa", "hellaswag")
PER_TASK = 20


def _megatron_tensors(model) -> dict[str, torch.Tensor]:
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


def _write_checkpoint(root: str, model, meta: dict) -> str:
    from train.checkpoint import layout
    from train.checkpoint.incremental import Piece, write_raw

    tmp = layout.tmp_dir_for(root, 1)
    os.makedirs(tmp)
    pieces = [Piece(k, tuple(t.shape), (0,) * t.dim(), t.detach().clone().contiguous())
              for k, t in _megatron_tensors(model).items()]
    stats = write_raw(tmp, 0, pieces)
    layout.commit(tmp, root, 1, "full", None, {"meta": meta}, hashed=stats["files"])
    return os.path.join(root, layout.ckpt_name(1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(HF folder written by `train ckpt export`, the transformers model it came from, EOS id)."""
    from click.testing import CliRunner
    from transformers import LlamaConfig, LlamaForCausalLM

    from datapipe.tokenize import train_bpe
    from storage.manifest import Manifest, TokenizerInfo, write_manifest
    from train.checkpoint.cli import ckpt

    base = tmp_path_factory.mktemp("evalhf")
    ds = base / "ds"
    texts = [d["text"] for d in read_corpus("shakespeare", 300)] + [d["text"] for d in read_corpus("fortunes", 300)]
    tok_path = train_bpe(texts, 1000, EOS, str(ds / "tokenizer.json"))
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(tok_path).token_to_id(EOS)
    sha = hashlib.sha256(open(tok_path, "rb").read()).hexdigest()
    write_manifest(str(ds), Manifest(TokenizerInfo("tokenizer.json", sha, 1000, eos_id, "uint16"), {}, []))

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"],
                      intermediate_size=SHAPE["ffn_hidden_size"], num_hidden_layers=SHAPE["num_layers"],
                      num_attention_heads=SHAPE["num_heads"], num_key_value_heads=SHAPE["num_kv_heads"],
                      max_position_embeddings=SHAPE["max_position_embeddings"], rope_theta=SHAPE["rope_theta"],
                      rms_norm_eps=SHAPE["norm_eps"], tie_word_embeddings=True, initializer_range=0.1)
    model = LlamaForCausalLM(cfg).eval()
    ck = _write_checkpoint(str(base / "ckpt"), model,
                           {"model": {"preset": "tiny", **SHAPE}, "tokenizer": str(ds / "tokenizer.json")})
    out = base / "hf"
    r = CliRunner().invoke(ckpt, ["export", ck, str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return str(out), model, eos_id


def test_export_writes_a_complete_hf_folder(exported):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, model, eos_id = exported
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors",
                                          "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == (EOS, EOS, EOS)
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == eos_id
    assert tok.model_max_length == SHAPE["max_position_embeddings"]
    text = "Question: What is the moon made of?\nAnswer: cheese, my lord" + EOS + " and more"
    ours = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == ours and eos_id in ours  # nothing added (no BOS), EOS is one token
    assert tok.decode(ours) == text
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (eos_id,) * 3
    gen = GenerationConfig.from_pretrained(folder)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (eos_id,) * 3
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([ours[:40]])
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max().item() < 1e-5


class RunsCode:
    """Pickles as a call of os.system: what a pytorch_model.bin from someone else could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_hf_folders_are_read_without_running_their_code(exported, tmp_path):
    """`train eval --hf`, `train generate` and `train ckpt import` read safetensors only and never run a
    folder's own code (config.json's auto_map), whoever made the folder."""
    from safetensors.torch import load_file

    from train.checkpoint.import_hf import ImportError_, weight_files
    from train.eval.hf import load_hf
    from train.generate import load

    folder, _, _ = exported
    marker = tmp_path / "code-ran"
    pickled = tmp_path / "pickled"  # weights as a pickle only
    shutil.copytree(folder, pickled)
    weights = load_file(str(pickled / "model.safetensors"))
    os.remove(pickled / "model.safetensors")
    torch.save({**weights, "extra": RunsCode(marker)}, pickled / "pytorch_model.bin")
    for fn in (load_hf, load):
        with pytest.raises(FileNotFoundError, match=f"{pickled}: no model.safetensors .*never pickled ones"):
            fn(str(pickled))
    remote = tmp_path / "remote"  # a config that asks for the folder's own model code
    shutil.copytree(folder, remote)
    (remote / "evil_model.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                          "from transformers import LlamaForCausalLM as EvilForCausalLM\n")
    cfg = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**cfg, "auto_map": {
        "AutoModelForCausalLM": "evil_model.EvilForCausalLM"}}))
    model = load_hf(str(remote))[0]
    assert type(model).__module__.startswith("transformers.")  # transformers' own Llama
    shutil.copy(remote / "model.safetensors", remote / "part.safetensors")
    os.remove(remote / "model.safetensors")
    (remote / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "part.safetensors", "lm_head.weight": "../x.safetensors"}}))
    with pytest.raises(ImportError_, match="weight_map names '../x.safetensors', not a .safetensors file in"):
        weight_files(str(remote))
    assert not marker.exists()


def test_eos_comes_from_the_dataset_manifest(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from storage.manifest import Manifest, TokenizerInfo, write_manifest
    from train.checkpoint.hf_tokenizer import resolve_eos, write_tokenizer_files

    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    raw = tok.to_str().encode()
    assert resolve_eos(raw, None) is None  # no dataset, no special token: unknown
    out = tmp_path / "out"
    assert write_tokenizer_files(str(out), raw, None, 64) == {}
    assert sorted(os.listdir(out)) == ["tokenizer.json"]  # as before: no config claiming a wrong EOS

    ds = tmp_path / "ds"
    os.makedirs(ds / "tok")
    (ds / "tok" / "tokenizer.json").write_bytes(raw)
    write_manifest(str(ds), Manifest(TokenizerInfo("tok/tokenizer.json", "0" * 64, 4, 3, "uint16"), {}, []))
    assert resolve_eos(raw, str(ds / "tok" / "tokenizer.json")) == ("</s>", 3)
    assert resolve_eos(raw, str(ds / "tok" / "tokenizer.json"), eos_token="world") == ("world", 2)
    tok.add_special_tokens(["<eos>"])  # a tokenizer trained by datapipe: its only special token
    assert resolve_eos(tok.to_str().encode(), str(tmp_path / "elsewhere.json")) == ("<eos>", 4)


def test_lm_eval_hf_backend_needs_the_tokenizer_config(exported, tmp_path):
    """The reported failure: without tokenizer_config.json lm-eval knows no EOS (prefix_token_id None)."""
    from storage.evaltasks import load_task
    from train.eval.lmeval import run_lmeval

    folder, _, _ = exported
    items = load_task("piqa", limit=3).items
    res = run_lmeval(folder, "piqa", items, str(tmp_path / "ok"), batch_size=4)
    assert [len(ll) for ll in res["logliks"]] == [len(it.requests) for it in items]
    old = tmp_path / "old_export"  # what the export wrote before: no tokenizer config, no special token ids
    shutil.copytree(folder, old)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        os.remove(old / name)
    for name in ("config.json", "generation_config.json"):
        cfg = {k: v for k, v in json.loads((old / name).read_text()).items() if not k.endswith("_token_id")}
        (old / name).write_text(json.dumps(cfg))
    with pytest.raises(TypeError):
        run_lmeval(str(old), "piqa", items, str(tmp_path / "old"), batch_size=4)


def test_score_hf_matches_lm_eval_harness(exported, tmp_path):
    from tokenizers import Tokenizer

    from storage.evaltasks import load_task
    from train.eval.hf import score_hf
    from train.eval.lmeval import run_lmeval

    folder, _, _ = exported
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tasks = [load_task(name, limit=PER_TASK) for name in TASKS]
    ours = score_hf(folder, tasks, batch_tokens=1024)  # several batches per task
    truncated = 0
    for task in tasks:
        ref = run_lmeval(folder, task.name, task.items, str(tmp_path / "lmeval"), batch_size=8)
        got = ours[task.name]
        assert len(got["logliks"]) == len(ref["logliks"]) == PER_TASK
        worst = max(abs(a - b) for la, lb in zip(got["logliks"], ref["logliks"]) for a, b in zip(la, lb, strict=True))
        assert worst < 1e-4, f"{task.name}: log-likelihoods differ by {worst}"
        assert (got["metrics"]["acc"], got["metrics"]["acc_norm"]) == (ref["acc"], ref["acc_norm"]), task.name
        assert got["metrics"]["items"] == PER_TASK
        assert all(n >= 1 for row in got["n_tokens"] for n in row)
        truncated += sum(len(tok.encode(r.context + r.continuation).ids) > SHAPE["max_position_embeddings"] + 1
                         for it in task.items for r in it.requests)
    assert truncated  # some contexts are longer than the model's positions: left truncation is compared too
