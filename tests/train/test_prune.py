"""The compression commands. `train ckpt prune` (train.checkpoint.prune): importance against a hand-computed
case; a width-pruned checkpoint (hidden, FFN and heads: head_dim no longer hidden / heads) gives the logits
of the transformers model built from its HF export at TP1, TP2 and PP2; depth pruning keeps the layers whose
removal changes the output most; bad arguments are refused by name. `train ckpt quantize`
(train.checkpoint.quantize) int8 / int4 from a checkpoint: every linear weight stored as integers in range
with one scale per row (int8) or per group (int4), within half a step of the source weight, and the folder
loads in transformers with logits near the float model's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from testutil import write_random_dataset
from train.checkpoint import prune as P

WORKER = os.path.join(os.path.dirname(__file__), "..", "checkpoint", "import_logits_worker.py")


def _tiny(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
                      initializer_range=0.5)
    return LlamaForCausalLM(cfg).eval()


def test_activation_importance_equals_a_hand_computed_case():
    """q and k are zero: every head averages the values of the positions so far, so each activation is a
    few lines of tensor algebra."""
    model = _tiny()
    lay = model.model.layers[0]
    with torch.no_grad():
        lay.self_attn.q_proj.weight.zero_()
        lay.self_attn.k_proj.weight.zero_()
    tokens = torch.randint(0, 16, (3, 7), generator=torch.Generator().manual_seed(1))
    imp = P.activation_importance(model, tokens, batch=2)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps) * w

    with torch.no_grad():
        x = model.model.embed_tokens.weight[tokens].double()
        n1 = rms(x, lay.input_layernorm.weight.double())
        v = (n1 @ lay.self_attn.v_proj.weight.double().T).reshape(3, 7, 2, 2)  # 2 KV heads of size 2
        ctx = v.cumsum(1) / torch.arange(1, 8).double().reshape(1, 7, 1, 1)    # causal mean of the values
        heads = ctx.repeat_interleave(2, dim=2)                                # 4 query heads, 2 per group
        h1 = x + heads.reshape(3, 7, 8) @ lay.self_attn.o_proj.weight.double().T
        n2 = rms(h1, lay.post_attention_layernorm.weight.double())
        act = torch.nn.functional.silu(n2 @ lay.mlp.gate_proj.weight.double().T) * (n2 @ lay.mlp.up_proj.weight.double().T)
        h2 = h1 + act @ lay.mlp.down_proj.weight.double().T
        n3 = rms(h2, model.model.norm.weight.double())

    def chan(t):
        return t.reshape(-1, t.shape[-1]).pow(2).mean(0).sqrt()

    want_hidden = chan(n1) + chan(n2) + chan(n3)
    want_ffn = chan(act)
    want_heads = heads.norm(dim=-1).reshape(-1, 4).pow(2).mean(0).sqrt()
    assert torch.allclose(imp["hidden"], want_hidden, rtol=1e-5)
    assert torch.allclose(imp["ffn"][0], want_ffn, rtol=1e-5)
    assert torch.allclose(imp["heads"][0], want_heads, rtol=1e-5)
    # ranks: the kept units are the largest by the hand-computed values
    assert P.top(imp["ffn"][0], 3).tolist() == sorted(want_ffn.argsort(descending=True)[:3].tolist())
    assert P.top(imp["hidden"], 5).tolist() == sorted(want_hidden.argsort(descending=True)[:5].tolist())
    assert P.top(torch.tensor([1.0, 3.0, 3.0, 2.0]), 2).tolist() == [1, 2]  # ties: the lower index


def test_layer_importance_is_the_output_change_when_dropped():
    model = _tiny()
    model.config.num_hidden_layers = 2
    model.model.layers.append(_tiny(1).model.layers[0])
    with torch.no_grad():  # layer 1 does nothing: dropping it changes nothing
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(2))
    imp = P.layer_importance(model, tokens)
    assert float(imp[1]) < 1e-12 < float(imp[0])
    full = torch.log_softmax(model(tokens).logits.double(), -1)
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[1]])
    drop0 = torch.log_softmax(model(tokens).logits.double(), -1)
    model.model.layers = layers
    assert abs(float((full.exp() * (full - drop0)).sum() / tokens.numel()) - float(imp[0])) < 1e-9


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib") / "ds"
    write_random_dataset(str(root), {"web": 40}, vocab_size=1000)
    return str(root)


def test_width_pruned_logits_equal_the_transformers_export(tiny_hf, tiny_ckpt, calib, tmp_path):
    from transformers import AutoModelForCausalLM

    from train.checkpoint.cli import ckpt

    _, _, _, ck, _ = tiny_hf
    out = tmp_path / "pruned"
    r = CliRunner().invoke(ckpt, ["prune", ck, str(out), "--width", "hidden=48,ffn=64,heads=2", "--data", calib,
                                  "--samples", "8", "--seq-len", "32"])
    assert r.exit_code == 0, r.output
    pruned = str(out / "step_00000000")
    m = json.load(open(os.path.join(pruned, "manifest.json")))["meta"]
    assert (m["model"]["hidden_size"], m["model"]["ffn_hidden_size"], m["model"]["num_heads"],
            m["model"]["head_dim"]) == (48, 64, 2, 16)
    assert len(m["prune"]["kept"]["hidden"]) == 48 and all(len(h) == 2 for h in m["prune"]["kept"]["heads"])
    r = CliRunner().invoke(ckpt, ["export", pruned, str(tmp_path / "hf")])
    assert r.exit_code == 0, r.output
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.head_dim == 16 and hf.config.hidden_size == 48
    tokens = (torch.arange(40).reshape(2, 20) * 37 % 900).long()
    torch.save(tokens, tmp_path / "tokens.pt")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          WORKER, str(tmp_path / "out.pt"), str(tmp_path / "tokens.pt"), pruned],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    got = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        want = hf(tokens).logits
    for layout in ((1, 1), (2, 1), (1, 2)):
        d = (got[(pruned, *layout)] - want).abs().max().item()
        assert d < 1e-4, (layout, d)
    # one `train eval` call compares the model (imported: a Megatron checkpoint) and its pruned child, each
    # under the shape its manifest records
    from train.cli import main

    r = CliRunner().invoke(main, ["eval", f"full={tiny_ckpt}", f"pruned={pruned}", "--tasks", "arc_easy", "--limit", "2",
                                  "--validation-tokens", "0", "--set", "data.seq_len=64", "--out", str(tmp_path / "cmp")])
    assert r.exit_code == 0, r.output
    sizes = {n: json.load(open(tmp_path / "cmp" / f"{n}.json"))["metrics"]["size_bytes"] for n in ("full", "pruned")}
    assert sizes["pruned"] < sizes["full"], sizes


def test_depth_pruning_keeps_the_important_layers_and_bad_arguments_are_refused(tiny_hf, calib, tmp_path):
    from train.checkpoint.cli import ckpt
    from train.checkpoint.export_hf import llama_weights

    _, _, _, ck, _ = tiny_hf
    out = tmp_path / "depth"
    r = CliRunner().invoke(ckpt, ["prune", ck, str(out), "--depth", "1", "--data", calib, "--samples", "4",
                                  "--seq-len", "32"])
    assert r.exit_code == 0, r.output
    meta = json.load(open(out / "step_00000000" / "manifest.json"))["meta"]
    imp = meta["prune"]["layer_importance"]
    assert meta["prune"]["kept_layers"] == [max(range(2), key=lambda i: imp[i])] and meta["model"]["num_layers"] == 1
    kept = meta["prune"]["kept_layers"][0]
    before, _, _ = llama_weights(ck)
    after, _, _ = llama_weights(str(out / "step_00000000"))
    assert torch.equal(after["model.layers.0.mlp.up_proj.weight"], before[f"model.layers.{kept}.mlp.up_proj.weight"])
    assert "model.layers.1.mlp.up_proj.weight" not in after
    for args, msg in ((["--depth", "1", "--width", "ffn=8"], "one of them"), ([], "one of them"), (["--depth", "3"], "1..2"),
                      (["--width", "heads=3"], "multiple of the 2 KV heads"), (["--width", "ffn=999"], "larger"),
                      (["--width", "depth=2"], "KEY=N")):
        r = CliRunner().invoke(ckpt, ["prune", ck, str(tmp_path / "bad"), "--data", calib, "--samples", "2",
                                      "--seq-len", "16", *args])
        assert r.exit_code != 0 and msg in r.output, (args, r.output)



def _expected(scores: torch.Tensor, k: int) -> list[int]:
    """The k most important units, ascending (ties: the lower index), written from the module doc."""
    return sorted(sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))[:k])


def test_ffn_and_head_pruning_equal_the_original_with_those_units_zeroed(tiny_hf, calib, tmp_path):
    """Removing FFN units and query heads is the same function as zeroing their rows of gate/up and their
    columns of o_proj in the original: a reference that shares no slicing code with the pruner. The kept
    units are the most important ones by the calibration activations."""
    from transformers import AutoModelForCausalLM

    from train.checkpoint.cli import ckpt
    from train.checkpoint.export_hf import llama_weights

    _, _, _, ck, _ = tiny_hf
    out = tmp_path / "pruned"
    r = CliRunner().invoke(ckpt, ["prune", ck, str(out), "--width", "ffn=64,heads=2", "--data", calib,
                                  "--samples", "8", "--seq-len", "32"])
    assert r.exit_code == 0, r.output
    kept = json.load(open(out / "step_00000000" / "manifest.json"))["meta"]["prune"]["kept"]
    weights, config, _ = llama_weights(ck)
    model = P.causal_lm(config, weights).eval()
    imp = P.activation_importance(model, P.calibration_tokens(calib, 8, 32))
    cfg = model.config
    per, hd = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    for i, layer in enumerate(model.model.layers):
        assert kept["ffn"][i] == _expected(imp["ffn"][i], 64)
        assert kept["heads"][i] == [g * per + j for g in range(cfg.num_key_value_heads)
                                    for j in _expected(imp["heads"][i, g * per:(g + 1) * per], 1)]
        with torch.no_grad():
            drop_f = sorted(set(range(cfg.intermediate_size)) - set(kept["ffn"][i]))
            layer.mlp.gate_proj.weight[drop_f] = 0.0
            layer.mlp.up_proj.weight[drop_f] = 0.0
            for h in set(range(cfg.num_attention_heads)) - set(kept["heads"][i]):
                layer.self_attn.o_proj.weight[:, h * hd:(h + 1) * hd] = 0.0
    r = CliRunner().invoke(ckpt, ["export", str(out / "step_00000000"), str(tmp_path / "hf")])
    assert r.exit_code == 0, r.output
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert pruned.config.intermediate_size == 64 and pruned.config.num_attention_heads == 2
    tokens = (torch.arange(40).reshape(2, 20) * 37 % 900).long()
    with torch.no_grad():
        d = (pruned(tokens).logits - model(tokens).logits).abs().max().item()
    assert d < 1e-4, d


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("scheme,group,qmax", [("int8-weight", None, 127), ("int4-weight", 32, 7)])
def test_quantized_weights_are_integers_within_half_a_step(tiny_hf, tiny_ckpt, tmp_path, scheme, group, qmax):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from train.checkpoint.cli import ckpt

    folder, model, *_ = tiny_hf
    out = tmp_path / scheme
    r = CliRunner().invoke(ckpt, ["quantize", tiny_ckpt, str(out), "--scheme", scheme])
    assert r.exit_code == 0, r.output + repr(r.exception)
    src = model.state_dict()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for i in range(model.config.num_hidden_layers):
            for lin in LINEARS:
                name = f"model.layers.{i}.{lin}"
                assert f"{name}.weight" not in keys, name  # no float copy of the weight
                q, scale, zero = (f.get_tensor(f"{name}._weight_{k}") for k in ("qdata", "scale", "zero_point"))
                w = src[f"{name}.weight"]
                assert q.dtype == torch.int8 and q.shape == w.shape, name
                g = group or w.shape[1]  # values per scale: a row (int8) or a group of a row (int4)
                assert scale.shape == (w.shape[0], w.shape[1] // g) and not zero.any(), name  # symmetric
                q, w = q.float().reshape(w.shape[0], -1, g), w.reshape(w.shape[0], -1, g)
                step = scale.unsqueeze(-1)
                assert q.abs().max() <= qmax + 1 and (q.abs().amax(-1) >= qmax - 1).all(), name  # the range is used
                assert ((q * step - w).abs() <= step / 2 + 1e-6).all(), name  # rounded to the nearest step
    quant = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 900, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(ids).logits, quant(ids).logits
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < (0.05 if qmax == 127 else 0.3), err
    assert json.loads((out / "config.json").read_text())["smoltrain_quantize"]["scheme"] == scheme
