"""A checkpoint exported by `train ckpt export` is a complete Hugging Face folder (tokenizer config with
EOS / BOS / padding, generation config) that transformers and lm-eval's HF backend load, and `score_hf`
(train eval --hf) gives the same per-candidate log-likelihoods and accuracies as lm-evaluation-harness.

The model is the small random-init Llama of tests/train/conftest.py (a raw smoltrain checkpoint next to a
dataset manifest and a BPE tokenizer trained on ../shared/corpora, exported through the CLI); no training,
no download (lm-eval runs offline)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from testutil import require

require("transformers")
require("lm_eval")

from tinyllama import EOS, SHAPE  # noqa: E402 - the shared tiny model (fixture tiny_hf: tests/train/conftest.py)
TASKS = ("arc_easy", "piqa", "hellaswag")
PER_TASK = 20


def test_export_writes_a_complete_hf_folder(tiny_hf):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, model, eos_id = tiny_hf[:3]
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
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


def test_hf_folders_are_read_without_running_their_code(tiny_hf, tmp_path):
    """`train eval --hf`, `train generate` and `train ckpt import` read safetensors only and never run a
    folder's own code (config.json's auto_map), whoever made the folder."""
    from safetensors.torch import load_file

    from train.checkpoint.import_hf import ImportError_, weight_files
    from train.eval.hf import load_hf
    from train.generation.load import load

    folder = tiny_hf[0]
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


def test_lm_eval_hf_backend_needs_the_tokenizer_config(tiny_hf, tmp_path):
    """The reported failure: without tokenizer_config.json lm-eval knows no EOS (prefix_token_id None)."""
    from storage.evaltasks import load_task
    from train.eval.lmeval import run_lmeval

    folder, _, _ = tiny_hf[:3]
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


def test_score_hf_matches_lm_eval_harness(tiny_hf, tmp_path):
    from tokenizers import Tokenizer

    from storage.evaltasks import load_task
    from train.eval.hf import score_hf
    from train.eval.lmeval import run_lmeval

    folder, _, _ = tiny_hf[:3]
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
