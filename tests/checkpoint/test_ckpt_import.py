"""`train ckpt import` (Hugging Face Llama folder → smoltrain checkpoint), its round trip through
`train ckpt export`, the imported model's logits under TP1 / TP2 / PP2 against transformers, `--init`'s
shape checks, and `train generate` against transformers' greedy generate.

The HF folders are made here: tiny random `LlamaForCausalLM`s (tied fp32, untied fp32, untied bf16) with a
byte-level BPE trained on a few lines and a ChatML chat template; no download."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from testutil import require

require("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LINES = ["the quick brown fox jumps over the lazy dog", "a small model learns to talk", "hello there, how are you?",
         "fine thanks and you", "tokens tokens tokens", "model checkpoints are imported and exported"] * 20
WORKER = os.path.join(os.path.dirname(__file__), "import_logits_worker.py")


def make_hf_folder(folder: str, tied: bool, dtype=torch.float32) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab_size()
    assert vocab % 128 and 260 < vocab <= 300
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    torch.manual_seed(1 if tied else 2)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=tied, initializer_range=0.1,
                      bos_token_id=tok.token_to_id("<|im_start|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
                      pad_token_id=tok.token_to_id("<|endoftext|>"))
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{name: (HF folder, imported checkpoint)} for tied fp32, untied fp32 and untied bf16 models."""
    from train.checkpoint.import_hf import import_folder

    base = tmp_path_factory.mktemp("import")
    out = {}
    for name, tied, dtype in (("tied", True, torch.float32), ("untied", False, torch.float32),
                              ("bf16", False, torch.bfloat16)):
        # the tied one where the Hub's cache puts a download: its export's card names it as base_model
        where = base / "models--HuggingFaceTB--SmolLM2-tied" / "snapshots" / "0a1b" if tied else base / f"hf-{name}"
        folder = make_hf_folder(str(where), tied, dtype)
        out[name] = (folder, import_folder(folder, str(base / f"ckpt-{name}"), timeout=300))
    return out


def _safetensors(folder: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.parametrize("name", ["tied", "untied", "bf16"])
def test_import_export_round_trip_is_tensor_identical(imported, name, tmp_path):
    from train.checkpoint.cli import ckpt

    folder, ck = imported[name]
    r = CliRunner().invoke(ckpt, ["verify", os.path.dirname(ck)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "hf"
    r = CliRunner().invoke(ckpt, ["export", ck, str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    a, b = _safetensors(folder), _safetensors(str(out))
    assert sorted(a) == sorted(b)
    assert ("lm_head.weight" in b) == (name != "tied")
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    for f in ("tokenizer.json", "tokenizer_config.json"):  # carried back verbatim
        assert (out / f).read_bytes() == open(os.path.join(folder, f), "rb").read()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(out)).chat_template == CHATML
    from huggingface_hub import ModelCard

    assert ModelCard.load(out / "README.md").data.base_model == ("HuggingFaceTB/SmolLM2-tied" if name == "tied"
                                                                  else None)
    cfg = json.loads((out / "config.json").read_text())
    orig = json.loads(open(os.path.join(folder, "config.json")).read())
    assert cfg["eos_token_id"] == orig["eos_token_id"] and cfg["tie_word_embeddings"] == (name == "tied")


def test_import_refuses_unsupported_configs(imported, tmp_path):
    from train.checkpoint.cli import ckpt

    folder, _ = imported["tied"]
    base = json.load(open(os.path.join(folder, "config.json")))
    cases = {"rope_scaling": {"rope_scaling": {"type": "linear", "factor": 2.0}},
             "attention_bias": {"attention_bias": True}, "mlp_bias": {"mlp_bias": True},
             "hidden_act": {"hidden_act": "gelu"}, "model_type": {"model_type": "mistral"},
             "rope_parameters.rope_type": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}}
    for field, change in cases.items():
        bad = tmp_path / field
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**base, **change}))
        r = CliRunner().invoke(ckpt, ["import", str(bad), str(tmp_path / f"out-{field}")])
        assert r.exit_code != 0 and f"unsupported '{field}'" in r.output, (field, r.output)
        assert not (tmp_path / f"out-{field}").exists()


def test_init_takes_the_shape_from_the_checkpoint_and_names_disagreeing_keys(imported, tmp_path):
    from storage import config as cfgmod
    from storage.config import ConfigError
    from train.checkpoint.init_from import resolve
    from train.config import TrainConfig

    _, ck = imported["untied"]
    cfg = cfgmod.load(TrainConfig, None, ["debug.synthetic_data=true", f"init={os.path.dirname(ck)}"])
    resolve(cfg)
    m = cfg.model
    assert cfg.init == ck  # the checkpoints folder resolves to its newest checkpoint
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_hidden_size) == (64, 4, 4, 2, 96)
    assert m.tie_embeddings is False and m.make_vocab_size_divisible_by == 1 and m.vocab_size % 128
    cfg = cfgmod.load(TrainConfig, None, ["debug.synthetic_data=true", f"init={ck}", "model.hidden_size=128",
                                          "model.num_layers=4", "model.tie_embeddings=true",
                                          "model.make_vocab_size_divisible_by=64"])
    with pytest.raises(ConfigError) as e:
        resolve(cfg)
    msg = str(e.value)
    assert "'model.hidden_size': 128 in the config, 64" in msg and "'model.make_vocab_size_divisible_by'" in msg
    assert "num_layers" not in msg and "tie_embeddings" not in msg  # equal / default: not an error
    cfg = cfgmod.load(TrainConfig, None, ["debug.synthetic_data=true", f"init={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="key 'init'.*no such checkpoint"):
        resolve(cfg)


def test_imported_logits_match_transformers_at_tp1_tp2_pp2(imported, tmp_path):
    from transformers import AutoModelForCausalLM

    tokens = (torch.arange(40).reshape(2, 20) * 37 % 250).long()
    torch.save(tokens, tmp_path / "tokens.pt")
    cks = [imported["tied"][1], imported["untied"][1]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", WORKER,
                        str(tmp_path / "out.pt"), str(tmp_path / "tokens.pt"), *cks],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    res = torch.load(tmp_path / "out.pt")
    for name in ("tied", "untied"):
        folder, ck = imported[name]
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(tokens).logits
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            got = res[(ck, tp, pp)]
            assert got.shape == want.shape, (name, tp, pp)
            assert (got - want).abs().max().item() < 1e-4, (name, tp, pp, (got - want).abs().max().item())


def test_generate_is_greedy_deterministic_and_equals_transformers(imported, tmp_path):
    from transformers import AutoModelForCausalLM

    from train.checkpoint.export_hf import export
    from train.cli import main
    from train.generation.chat import generate, load

    folder, ck = imported["untied"]
    loaded = load(ck)
    a = generate(ck, "hello there", system="be brief", max_new_tokens=12, loaded=loaded)
    b = generate(ck, "hello there", system="be brief", max_new_tokens=12, loaded=loaded)
    assert a.new_ids == b.new_ids and a.prompt_text.endswith("<|im_start|>assistant\n")
    assert a.prompt_text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there")
    im_end = loaded[1].convert_tokens_to_ids("<|im_end|>")
    assert im_end in a.stop_ids
    out = tmp_path / "hf"
    export(ck, str(out))
    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    x = torch.tensor([a.prompt_ids])
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                            eos_token_id=a.stop_ids, pad_token_id=a.stop_ids[0])
    assert want[0, len(a.prompt_ids):].tolist() == a.new_ids
    hf = generate(folder, "hello there", system="be brief", max_new_tokens=12)  # the HF folder: same path
    assert hf.new_ids == a.new_ids and hf.prompt_ids == a.prompt_ids
    # seeded sampling: the same seed repeats, another seed differs, and seed 3's sample is the one transformers
    # draws from the exported folder with the same temperature and top_p after the engine's seeding of its
    # first batch (torch.manual_seed(seed * 1_000_003 + batch), train.generation.engine)
    sampled = [generate(ck, "hi", temperature=0.7, top_p=0.9, seed=s, max_new_tokens=8, loaded=loaded)
               for s in (3, 3, 4)]
    assert sampled[0].new_ids == sampled[1].new_ids != sampled[2].new_ids
    from transformers import GenerationConfig

    x = torch.tensor([sampled[0].prompt_ids])
    torch.manual_seed(3 * 1_000_003)
    with torch.no_grad():
        want = ref.generate(x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(
            max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.9, top_k=0, eos_token_id=sampled[0].stop_ids,
            pad_token_id=sampled[0].stop_ids[0]))
    assert want[0, x.shape[1]:].tolist() == sampled[0].new_ids
    r = CliRunner().invoke(main, ["generate", ck, "--chat", "hello there", "--system", "be brief",
                                  "--max-new-tokens", "12"])
    assert r.exit_code == 0 and r.output.strip() == a.text.strip(), r.output
    r = CliRunner().invoke(main, ["generate", folder, "--chat", "the quick", "--no-chat", "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    # prompt-lookup speculative decoding: the same reply, its acceptance and speed-up printed
    r = CliRunner().invoke(main, ["generate", ck, "--chat", "hello there", "--system", "be brief",
                                  "--max-new-tokens", "12", "--prompt-lookup", "4"])
    assert r.exit_code == 0 and r.stdout.strip() == a.text.strip(), r.output
    assert "acceptance" in r.stderr and "output identical to plain generation" in r.stderr, r.stderr
