"""`train ckpt merge --linear / --soup`: the merged weights are exactly the float64 weighted average of the
inputs' (read back from any layout) cast to their dtype; a merge of a TP=2 run and a PP=2 run loads in
`train eval`, exports with the first input's tokenizer and chat template, and starts a run with `--init`;
bad input is refused with a message naming the problem.

The two runs are real `train launch` runs (tiny model, 2 steps, a full checkpoint per step) on a small
random-token dataset whose tokenizer is a byte-level BPE trained here (so the checkpoints record a
tokenizer and a chat template, as a real run's do)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import yaml
from click.testing import CliRunner

from testutil import free_port, run_killable, write_random_dataset

pytestmark = pytest.mark.slow
TRAIN = os.path.join(os.path.dirname(sys.executable), "train")
# vocab 512: padded to the same 512 rows at TP1 and TP2, so the two runs' tensors have equal shapes
MODEL = {"preset": "tiny", "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 96, "vocab_size": 512}
LINES = ["the quick brown fox jumps over the lazy dog", "a small model learns to talk", "hello there, how are you?",
         "merged weights average the runs", "soups of checkpoints"] * 20


def _config(base, name, dataset, parallel, **over) -> str:
    cfg = {"run_dir": str(base / name), "steps": 2, "seed": 5, "model": MODEL,
           "parallel": {"micro_batch_size": 1, "global_batch_size": 2, **parallel},
           "data": {"dataset": dataset, "seq_len": 32, "seed": 7},
           "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 1, "incremental_every": 0, "keep_last": 5, "keep_full_every": 0,
                          "async_save": False}, **over}
    path = base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _launch(args, log):
    rc = run_killable([TRAIN, "launch", *args, "--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], log,
                      timeout=300)
    assert rc == 0, open(log).read()[-5000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(base folder, dataset, {tp2, pp2: run dir}): two 2-step runs of the same model at TP=2 and PP=2."""
    from datapipe.tokenize import train_bpe
    from storage.manifest import write_manifest

    base = tmp_path_factory.mktemp("merge")
    ds = str(base / "ds")
    m = write_random_dataset(ds, {"web": 30}, vocab_size=300, eos_id=0)
    train_bpe(LINES, 300, "<|endoftext|>", os.path.join(ds, "tokenizer.json"), ["<|im_start|>", "<|im_end|>"])
    m.chat_template = "chatml"
    write_manifest(ds, m)
    procs = []
    for name, par in (("tp2", {"tp": 2}), ("pp2", {"pp": 2})):
        procs.append((name, subprocess.Popen(
            [TRAIN, "launch", _config(base, name, ds, par), "--nproc", "2",
             "--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"],
            stdout=open(base / f"{name}.log", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"})))
    for name, p in procs:
        assert p.wait(timeout=300) == 0, (base / f"{name}.log").read_text()[-5000:]
    return base, ds, {"tp2": base / "tp2", "pp2": base / "pp2"}


def _ckpt(run, step: int) -> str:
    return str(run / "checkpoints" / f"step_{step:08d}")


def _merge(*args):
    from train.checkpoint.cli import ckpt

    return CliRunner().invoke(ckpt, ["merge", *map(str, args)])


def _weights(path):
    from train.checkpoint.export_hf import llama_weights

    return llama_weights(str(path))[0]


def _raw_model_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    """Whole model tensors (megatron keys) of a raw full checkpoint, read here from its rank files with
    numpy, not with the readers the merge itself uses (PieceSet, export_hf.llama_weights): every piece is
    put at its global offset and every element must be written exactly once."""
    out, seen = {}, {}
    for index in sorted((Path(ckpt) / "tensors").glob("rank*.json")):
        blob = np.fromfile(index.with_suffix(".bin"), dtype=np.uint8)
        for e in json.loads(index.read_text())["entries"]:
            if e["key"].startswith("optimizer"):
                continue
            assert e["codec"] == "raw", e
            dtype = getattr(torch, e["dtype"])
            go, shape = e["global_offset"], e["shape"]
            ext = [1] * (len(go) - len(shape)) + shape  # pieces may leave out leading (stacked-layer) axes
            piece = torch.frombuffer(bytearray(blob[e["offset"]:e["offset"] + e["nbytes"]]), dtype=dtype)
            region = tuple(slice(o, o + n) for o, n in zip(go, ext, strict=True))
            t = out.setdefault(e["key"], torch.zeros(e["global_shape"], dtype=dtype))
            count = seen.setdefault(e["key"], torch.zeros(e["global_shape"], dtype=torch.int8))
            t[region] = piece.reshape(ext)
            count[region] += 1
    for k, count in seen.items():
        assert bool((count == 1).all()), f"{ckpt}: {k}: pieces do not cover the tensor exactly once"
    assert out, f"{ckpt}: no model tensors"
    return out


def _expect_average(out: str, inputs: list[tuple[str, float]]) -> None:
    """The merged checkpoint's tensors equal Σ w × t in float64 (inputs in order), cast: bit for bit."""
    got = _raw_model_tensors(out)
    ws = [(_raw_model_tensors(p), w) for p, w in inputs]
    assert sorted(got) == sorted(ws[0][0])
    for k, v in got.items():
        want = ws[0][0][k].double() * ws[0][1]
        for t, w in ws[1:]:
            want = want + t[k].double() * w
        assert v.dtype == ws[0][0][k].dtype, k
        assert torch.equal(v, want.to(v.dtype)), k
    assert any(not torch.equal(got[k], ws[0][0][k]) for k in got)  # the inputs do differ


@pytest.fixture(scope="module")
def merged(runs):
    """`train ckpt merge` run twice side by side: {"linear": 0.9 × the TP=2 run (its run dir: the newest
    checkpoint) + 0.1 × the PP=2 run's step 2, "soup": the TP=2 run's steps 1 and 2 and the PP=2 run's
    step 2} → (merged step folder, output, the inputs and weights)."""
    base, _, r = runs
    jobs = {"linear": (["--linear", f"{r['tp2']}:0.9", f"{_ckpt(r['pp2'], 2)}:0.1"],
                       [(_ckpt(r["tp2"], 2), 0.9), (_ckpt(r["pp2"], 2), 0.1)]),
            "soup": (["--soup", _ckpt(r["tp2"], 1), _ckpt(r["tp2"], 2), _ckpt(r["pp2"], 2)],
                     [(_ckpt(r["tp2"], 1), 1 / 3), (_ckpt(r["tp2"], 2), 1 / 3), (_ckpt(r["pp2"], 2), 1 / 3)])}
    procs = {name: subprocess.Popen([TRAIN, "ckpt", "merge", *args, str(base / name)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for name, (args, _) in jobs.items()}
    out = {}
    for name, p in procs.items():
        output = p.communicate(timeout=300)[0]
        assert p.returncode == 0, output[-5000:]
        out[name] = (str(base / name / "step_00000000"), output, jobs[name][1])
    return out


def test_linear_merge_is_the_weighted_average_and_records_its_provenance(runs, merged):
    _, ds, _ = runs
    out, output, weighted = merged["linear"]
    assert "merged 2 checkpoints (linear)" in output and "warning" not in output
    _expect_average(out, weighted)
    inputs = [p for p, _ in weighted]
    m = json.load(open(os.path.join(out, "manifest.json")))
    assert m["step"] == 0 and m["layout"]["tp"] == 1 and m["layout"]["pp"] == 1
    assert open(os.path.join(os.path.dirname(out), "latest")).read().strip() == "step_00000000"
    meta = m["meta"]
    assert meta["tokenizer"] == os.path.join(ds, "tokenizer.json") and meta["padded_vocab_size"] == 512
    assert meta["model"]["hidden_size"] == 64 and meta["precision"] == "fp32"
    prov = meta["merge"]
    assert prov["method"] == "linear" and prov["normalized"] is False
    assert [(i["checkpoint"], i["weight"], i["step"]) for i in prov["inputs"]] == [(inputs[0], 0.9, 2),
                                                                                  (inputs[1], 0.1, 2)]
    for i in prov["inputs"]:
        digest = xxhash.xxh3_128(open(os.path.join(i["checkpoint"], "manifest.json"), "rb").read()).hexdigest()
        assert i["manifest_xxh3_128"] == digest
    from train.checkpoint.cli import ckpt

    res = CliRunner().invoke(ckpt, ["verify", os.path.dirname(out)])
    assert res.exit_code == 0, res.output


def test_soup_of_three_is_the_mean(merged):
    out, output, weighted = merged["soup"]
    assert "merged 3 checkpoints (soup)" in output
    inputs = [p for p, _ in weighted]
    _expect_average(out, weighted)
    got, ws = _raw_model_tensors(out), [_raw_model_tensors(p) for p in inputs]
    for k in got:
        assert torch.allclose(got[k].double(), torch.stack([w[k].double() for w in ws]).mean(0), rtol=0, atol=1e-7)
    prov = json.load(open(os.path.join(out, "manifest.json")))["meta"]["merge"]
    assert prov["method"] == "soup" and [i["weight"] for i in prov["inputs"]] == [1 / 3] * 3


def test_merged_checkpoint_evaluates_exports_and_starts_a_run(runs, merged, tmp_path):
    from safetensors.torch import load_file

    from train.checkpoint.cli import ckpt

    _, ds, _ = runs
    out = merged["linear"][0]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ev = subprocess.Popen([TRAIN, "eval", out, "--validation-tokens", "0", "--tasks", "piqa", "--limit", "4",
                           "--out", str(tmp_path / "eval")], env=env, stdout=open(tmp_path / "eval.log", "w"),
                          stderr=subprocess.STDOUT)  # beside the --init run below (one process each)
    cfg = _config(tmp_path, "sft", ds, {}, steps=1, model={"preset": "tiny"})
    _launch([cfg, "--nproc", "1", "--init", os.path.dirname(out)], tmp_path / "sft.log")
    events = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "init" for e in events) and (tmp_path / "sft" / "checkpoints" / "step_00000001").is_dir()
    assert yaml.safe_load((tmp_path / "sft" / "config.yaml").read_text())["init"] == out

    res = CliRunner().invoke(ckpt, ["export", out, str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    exported, merged = load_file(str(tmp_path / "hf" / "model.safetensors")), _weights(out)
    assert sorted(exported) == sorted(merged) and all(torch.equal(exported[k], merged[k]) for k in merged)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == open(os.path.join(ds, "tokenizer.json"), "rb").read()
    tc = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"] and tc["eos_token"] == "<|endoftext|>"

    assert ev.wait(timeout=300) == 0, (tmp_path / "eval.log").read_text()[-5000:]
    res = json.load(open(tmp_path / "eval" / "step_00000000.json"))
    assert res["tasks"]["piqa"]["metrics"]["items"] == 4


def test_bad_input_is_refused_with_a_clear_message(runs, tmp_path):
    from train.checkpoint.merge import MergeError, check_same_tensors, make_plan, parse_inputs

    _, _, r = runs
    tp2, pp2 = _ckpt(r["tp2"], 2), _ckpt(r["pp2"], 2)
    out = tmp_path / "out"
    cases = [
        (["--soup", tp2, tmp_path / "nope", out], "merge input 2: " + str(tmp_path / "nope") + ": no such checkpoint"),
        (["--soup", tp2, out], "--soup needs at least 2 checkpoints to merge, got 1"),
        (["--linear", f"{tp2}:0.5", f"{pp2}:0.4", out], "--linear weights sum to 0.9, not 1"),
        (["--linear", tp2, f"{pp2}:1", out], "give CHECKPOINT:WEIGHT"),
        ([tp2, pp2, out], "choose --linear"),
        (["--soup", tp2, pp2, os.path.dirname(tp2)], "already holds checkpoints"),
    ]
    for args, msg in cases:
        res = _merge(*args)
        assert res.exit_code != 0 and msg in res.output, (args, res.output)
    assert not out.exists()
    assert [w for _, w, _ in parse_inputs("linear", ["a:1", "b:3"], normalize=True)] == [0.25, 0.75]
    with pytest.raises(MergeError, match="sum to 0"):
        parse_inputs("linear", ["a:1", "b:-1"], normalize=True)

    # another model shape: a copy of a checkpoint whose manifest records hidden_size 128 (checked before
    # any tensor is read), and at the tensor level the first differing tensor is named
    other = tmp_path / "other" / "step_00000002"
    shutil.copytree(pp2, other)
    m = json.loads((other / "manifest.json").read_text())
    m["meta"]["model"]["hidden_size"] = 128
    m["meta"]["tokenizer"] = str(tmp_path / "tok.json")
    (tmp_path / "tok.json").write_text("{}")
    (other / "manifest.json").write_text(json.dumps(m))
    res = _merge("--soup", tp2, other, out)
    assert res.exit_code != 0 and f"key 'model.hidden_size' is 64 in {tp2}, 128 in {other}" in res.output, res.output
    m["meta"]["model"]["hidden_size"] = 64
    (other / "manifest.json").write_text(json.dumps(m))
    _, warnings = make_plan([(tp2, 0.5, 0.5), (str(other), 0.5, 0.5)], "soup", False)
    assert len(warnings) == 1 and f"the tokenizer of {other}" in warnings[0] and "carries the first's" in warnings[0]
    ref = {"a.weight": (4, 2), "b.weight": (3,)}
    with pytest.raises(MergeError, match=r"tensor 'a.weight' has shape \(4, 2\) in A, \(5, 2\) in B"):
        check_same_tensors(ref, {"a.weight": torch.zeros(5, 2), "b.weight": torch.zeros(3)}, "A", "B")
    with pytest.raises(MergeError, match="tensor 'b.weight' is in A but not in B"):
        check_same_tensors(ref, {"a.weight": torch.zeros(4, 2)}, "A", "B")
