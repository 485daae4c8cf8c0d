"""Evaluation end to end on a model trained here: `datapipe build` with a held-out split → `train launch`
with in-loop evaluation → `train eval` of the same checkpoint under DP1, DP2, TP2 and PP2 → the same
items through lm-evaluation-harness (HF backend) on the `train ckpt export` folder; table, plot, bad input,
two labeled targets (a chain's stages) in one worker and their table."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from testutil import read_corpus, write_jsonl

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TASKS = ["arc_easy", "piqa", "hellaswag"]
LIMIT = 50  # 3 tasks × 50 = 150 items
GOLD = "codex_humaneval:gold_bpb_0shot"  # code's early signal: bits per byte of HumanEval's canonical solutions


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", *args], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny model trained 40 steps on two real sources with a held-out split, evaluating every 20 steps."""
    from datapipe.tokenize import train_bpe

    root = tmp_path_factory.mktemp("evalrun")
    docs, books = read_corpus("pydoc", 500), read_corpus("shakespeare", 120)
    tok = train_bpe([d["text"] for d in docs[:300] + books[:60]], 2048, "<|endoftext|>", str(root / "tok.json"))
    build = {"output": str(root / "data"), "tokenizer": {"path": tok},
             "sources": [{"name": "docs", "paths": [write_jsonl(root / "in" / "docs.jsonl", docs)], "filters": []},
                         {"name": "books", "paths": [write_jsonl(root / "in" / "books.jsonl", books)], "filters": []}],
             "validation": {"fraction": 0.08}, "shards": {"block_tokens": 16384, "shard_blocks": 8}}
    (root / "build.yaml").write_text(yaml.safe_dump(build))
    r = _cli("datapipe.cli", "build", str(root / "build.yaml"), "--workers", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    train = {"run_dir": str(root / "run"), "steps": 40, "seed": 3, "model": {"preset": "tiny"},
             "data": {"dataset": str(root / "data"), "seq_len": 128},
             "parallel": {"tp": 2, "micro_batch_size": 4, "global_batch_size": 16},
             "optim": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 10},
             "monitor": {"log_every": 10}, "checkpoint": {"full_every": 20, "incremental_every": 0},
             "eval": {"every": 20, "validation_tokens": 4096, "tasks": ["piqa", GOLD], "limit": 10}}
    (root / "train.yaml").write_text(yaml.safe_dump(train))
    r = _cli("train.cli", "launch", str(root / "train.yaml"), "--nproc", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return root


def _evals(run_root: Path, layouts: dict[str, tuple]) -> dict[str, dict]:
    """`train eval` of the step-40 checkpoint under each layout {name: (nproc, *--set overrides)}, two at a
    time (their start-up, imports and model building, is mostly one core each)."""
    names, out = list(layouts), {}
    for pair in (names[i:i + 2] for i in range(0, len(names), 2)):
        procs = {}
        for name in pair:
            nproc, *sets = layouts[name]
            args = ["train.cli", "eval", str(run_root / "run"), "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
                    "--validation-tokens", "4096", "--nproc", str(nproc), "--out", str(run_root / name)]
            for s in sets:
                args += ["--set", s]
            procs[name] = subprocess.Popen([sys.executable, "-m", *args], env=_env(), cwd=REPO, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=600)
            assert p.returncode == 0, (name, stdout[-3000:] + stderr[-3000:])
            out[name] = json.loads((run_root / name / "step_00000040.json").read_text())
    return out


@pytest.fixture(scope="module")
def evaluated(run):
    """`train eval RUN --all` with the in-loop evaluation's settings (piqa and HumanEval's gold bpb, 10 items,
    4096 validation tokens): results for both checkpoints in RUN/run/eval/."""
    r = _cli("train.cli", "eval", str(run / "run"), "--all", "--tasks", f"piqa,{GOLD}", "--limit", "10",
             "--validation-tokens", "4096")
    assert r.returncode == 0, r.stderr[-3000:]
    return {s: json.loads((run / "run" / "eval" / f"step_{s:08d}.json").read_text()) for s in (20, 40)}


def test_in_loop_evaluation_is_logged(run, evaluated):
    recs = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [20, 40]
    for r in evals:
        for key in ("val/docs/loss", "val/books/loss", "val/all/loss", "val/all/ppl", "val/all/bpb",
                    "eval/piqa/acc", "eval/piqa/acc_norm", "eval/piqa/acc_token", "eval/codex_humaneval/bpb",
                    "eval_time_s"):
            assert key in r, key
        assert 0.5 < r["eval/codex_humaneval/bpb"] < 20
        assert r["val/all/ppl"] == pytest.approx(math.exp(r["val/all/loss"]))
        assert 0 < r["val/all/bpb"] < r["val/all/loss"] / math.log(2)  # a token holds more than one byte
        # the numbers `train eval` gives for the checkpoint of that step (another layout: TP1 there, TP2 here)
        ref = evaluated[r["step"]]["metrics"]
        assert {k for k in r if k.startswith(("val/", "eval/"))} == {k for k in ref if k.startswith(("val/", "eval/"))}
        for k in ref:
            if k.startswith("val/") or k.endswith("/bpb"):
                assert r[k] == pytest.approx(ref[k], rel=1e-5), (r["step"], k)
            elif k.startswith("eval/"):
                assert r[k] == ref[k], (r["step"], k)
    assert evals[0]["val/all/loss"] != pytest.approx(evals[1]["val/all/loss"], rel=1e-3)  # the model moved on
    assert evals[1]["val/all/loss"] < math.log(2048)  # learnt something on held-out text
    assert all("eval_time_s" not in r for r in recs if "loss" in r)  # kept out of training records
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "run" / "tb"))
    acc.Reload()
    assert {"val/all/loss", "val/docs/bpb", "eval/piqa/acc_norm"} <= set(acc.Tags()["scalars"])


def test_same_numbers_under_every_layout_and_parity_with_lm_eval(run):
    from storage.evaltasks import load_task
    from train.eval.lmeval import run_lmeval

    layouts = _evals(run, {"dp1": (1,), "dp2": (2,), "tp2": (2, "parallel.tp=2"), "pp2": (2, "parallel.pp=2")})
    ref = layouts["dp1"]["metrics"]
    val_keys = [k for k in ref if k.startswith("val/")]
    assert {"val/docs/loss", "val/books/loss", "val/all/bpb"} <= set(val_keys)
    for name, res in layouts.items():
        assert res["layout"]["dp" if name.startswith("dp") else name[:2]] == int(name[-1])
        for k in val_keys:
            assert res["metrics"][k] == pytest.approx(ref[k], rel=1e-6), (name, k)

    r = _cli("train.cli", "ckpt", "export", str(run / "run" / "checkpoints" / "step_00000040"), str(run / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    n_items = 0
    for task in TASKS:
        items = load_task(task, LIMIT).items
        ref = run_lmeval(str(run / "hf"), f"parity_{task}", items, str(run / "lmeval"))
        assert len(ref["logliks"]) == len(items) == LIMIT
        n_items += len(items)
        for name, res in layouts.items():  # every layout: each item once, in order, each candidate's score
            ours = res["tasks"][task]
            assert ours["item_ids"] == [it.item_id for it in items] and ours["metrics"]["items"] == len(items)
            assert len(ours["logliks"]) == len(items), (task, name)
            for it, ll, want in zip(items, ours["logliks"], ref["logliks"], strict=True):
                assert len(ll) == len(want) == len(it.requests), (task, name, it.item_id)
                assert max(abs(a - b) for a, b in zip(ll, want, strict=True)) < 1e-4, (task, name, it.item_id)
            assert ours["metrics"]["acc"] == ref["acc"] and ours["metrics"]["acc_norm"] == ref["acc_norm"], (task, name)
            assert res["metrics"][f"eval/{task}/acc"] == ref["acc"]
    assert n_items >= 150
    # `train eval --hf` on the same folder: the transformers backend gives the Megatron numbers too
    r = _cli("train.cli", "eval", "--hf", str(run / "hf"), "--tasks", "piqa", "--limit", "10", "--out",
             str(run / "hf_eval.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    hf = json.loads((run / "hf_eval.json").read_text())["tasks"]["piqa"]
    assert hf["item_ids"] == [it.item_id for it in load_task("piqa", 10).items]  # (a subset of the 50 above)
    assert len(hf["logliks"]) == len(set(hf["item_ids"])) == hf["metrics"]["items"] == 10
    tp2 = layouts["tp2"]["tasks"]["piqa"]
    ours = dict(zip(tp2["item_ids"], tp2["logliks"], strict=True))
    for item_id, ll in zip(hf["item_ids"], hf["logliks"], strict=True):
        assert len(ll) == len(ours[item_id]) and ll == pytest.approx(ours[item_id], abs=1e-4), item_id


def test_table_and_plot(run, evaluated):
    r = _cli("train.cli", "eval", "--table", str(run / "run"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:9] == ["checkpoint", "step", "tokens", "val", "loss", "val", "bpb", "codex_humaneval",
                                    "bpb"] and "piqa" in lines[0]
    rows = [ln.split() for ln in lines[1:] if ln.startswith("step_")]
    assert [row[0] for row in rows] == ["step_00000020", "step_00000040"]
    res = evaluated[40]
    assert float(rows[1][3]) == pytest.approx(res["metrics"]["val/all/loss"], abs=1e-4)
    assert float(rows[1][5]) == pytest.approx(res["tasks"]["codex_humaneval"]["metrics"]["bpb"], abs=1e-3)
    assert float(rows[1][6]) == pytest.approx(res["tasks"]["piqa"]["metrics"]["acc_norm"], abs=1e-3)
    r = _cli("train.cli", "plot", str(run / "run"))
    assert r.returncode == 0, r.stderr
    assert (run / "run" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the export's model card: the Hub's metadata (huggingface_hub reads it), this checkpoint's results as
    # model-index, the table `train eval --table` printed for it, the recipe
    from click.testing import CliRunner
    from huggingface_hub import ModelCard

    from train.checkpoint.cli import ckpt

    out = run / "hf_card"
    r = CliRunner().invoke(ckpt, ["export", str(run / "run" / "checkpoints" / "step_00000040"), str(out),
                                  "--license", "apache-2.0"])
    assert r.exit_code == 0, r.output
    card = ModelCard.load(out / "README.md")
    d = card.data
    assert (d.license, d.library_name, d.pipeline_tag, d.datasets) == ("apache-2.0", "transformers",
                                                                       "text-generation", ["data"])
    assert "pretrain" in d.tags and d.base_model is None
    got = {(e.dataset_type, e.metric_type): e.metric_value for e in d.eval_results}
    for task, t in res["tasks"].items():
        for metric in ("acc", "acc_norm", "bpb"):
            if metric in t["metrics"]:
                assert got.pop((task, metric)) == t["metrics"][metric], (task, metric)
    assert got.pop(("validation", "bpb")) == res["metrics"]["val/all/bpb"]
    block = card.text.split("```")[1].strip().splitlines()
    assert block[0].split() == lines[0].split() and block[1].split() == rows[1]
    assert f"| 0 | pretrain | random init | 40 | {res['consumed_tokens']:,} | 128 | 0.003 (0.0003) |" in card.text


def test_bad_input_messages(run, tmp_path):
    r = _cli("train.cli", "eval", str(run / "run"), "--tasks", "hellaswagg")
    assert r.returncode == 2 and "unknown task 'hellaswagg'" in r.stderr and "arc_challenge" in r.stderr
    bad = tmp_path / "mine.jsonl"
    bad.write_text(json.dumps({"doc_id": 1, "context": "Q:", "continuation": " a", "label": 0}) + "\n"
                   + json.dumps({"doc_id": 1, "context": "Q:", "continuation": 5, "label": 0}) + "\n")
    r = _cli("train.cli", "eval", str(run / "run"), "--tasks", f"mine={bad}")
    assert r.returncode == 2 and f"{bad}:2" in r.stderr and "'continuation'" in r.stderr
    # a dataset without a held-out split: a clear warning, then the benchmarks still run
    ds = run / "data"
    man = json.loads((ds / "manifest.json").read_text())
    old = tmp_path / "old"
    old.mkdir()
    for name in ("tokenizer.json",):
        (old / name).write_bytes((ds / name).read_bytes())
    for src in man["sources"]:
        (old / src).symlink_to(ds / src)
    man.pop("validation")
    (old / "manifest.json").write_text(json.dumps(man))
    # (two labeled targets in one worker, as for the stages of a chain: results named by label, the table
    # in the order given, neither by step nor by name)
    ckpts = run / "run" / "checkpoints"
    r = _cli("train.cli", "eval", f"late={ckpts / 'step_00000040'}", f"early={ckpts / 'step_00000020'}", "--tasks",
             "piqa", "--limit", "5", "--set", f"data.dataset={old}", "--out", str(tmp_path / "res"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "has no validation split" in r.stderr
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["early.json", "late.json"]
    res = json.loads((tmp_path / "res" / "late.json").read_text())
    assert res["label"] == "late" and res["checkpoint"] == "step_00000040" and res["step"] == 40
    assert res["path"] == str((ckpts / "step_00000040").resolve())
    assert "eval/piqa/acc" in res["metrics"] and not any(k.startswith("val/") for k in res["metrics"])
    early = json.loads((tmp_path / "res" / "early.json").read_text())
    assert early["label"] == "early" and early["step"] == 20 and early["evaluated_at"] > res["evaluated_at"]
    r = _cli("train.cli", "eval", "--table", str(tmp_path / "res"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "label"
    assert [ln.split()[:2] for ln in r.stdout.splitlines()[1:3]] == [["late", "40"], ["early", "20"]]
