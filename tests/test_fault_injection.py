"""End to end under faults: `datapipe build` killed -9 once (in a stage drawn from a seed) and `train launch`
killed -9 twice (at a step drawn from the seed, then while the run's last checkpoint is being written, in
its last 10 %), each rerun to the end, leave the whole output trees of an uninterrupted build → train run,
hidden files included (tools.outtree): shards, work files, rejects, reports, checkpoints, `latest`, the
recycled tensor files, and the loss trace in metrics.jsonl. The interrupted save's temporary folder is gone
after the next save."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import yaml
from testutil import free_port, metric_records, read_corpus, run_killable

from tools.outtree import BUILD_VOLATILE, TRAIN_VOLATILE, differences, tree

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
SEED = int(os.environ.get("SMOLTRAIN_FAULT_SEED", "20261202"))
STEPS = 16


def _write_inputs(root: Path) -> dict[str, list[str]]:
    inputs = {}
    for name, corpus, n in (("web", "fortunes", 3000), ("docs", "pydoc", 200)):
        docs = read_corpus(corpus, n)
        paths = []
        for part in range(2):
            p = root / f"{name}-{part}.jsonl"
            p.write_text("".join(json.dumps({"id": d["id"], "text": d["text"]}) + "\n" for d in docs[part::2]))
            paths.append(str(p))
        inputs[name] = paths
    return inputs


def _build_config(tmp: Path, inputs: dict, out: Path) -> Path:
    cfg = {"output": str(out), "tokenizer": {"vocab_size": 2048},
           "shards": {"block_tokens": 8192, "shard_blocks": 4},
           "sources": [{"name": "docs", "paths": inputs["docs"]}, {"name": "web", "paths": inputs["web"]}],
           "mix": {"phases": [{"name": "stable", "weights": {"web": 0.6, "docs": 0.4}, "fraction": 0.8},
                              {"name": "decay", "weights": {"web": 0.3, "docs": 0.7}, "fraction": 0.2}]}}
    path = tmp / f"build-{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train_config(tmp: Path, run_dir: Path, dataset: Path) -> Path:
    cfg = {"run_dir": str(run_dir), "steps": STEPS, "seed": 1234, "model": {"preset": "tiny"},
           "parallel": {"tp": 2, "micro_batch_size": 2, "global_batch_size": 4},
           "data": {"dataset": str(dataset), "seq_len": 64, "seed": 7},
           "optim": {"lr": 1.0e-3, "min_lr": 1.0e-4, "warmup_steps": 2, "schedule": "wsd"},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 6, "incremental_every": 2, "keep_last": 3, "keep_full_every": 0}}
    path = tmp / f"train-{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _trace(run_dir: Path) -> dict[int, tuple]:
    """step → (loss, grad_norm, consumed_tokens), the last record of each step (re-run steps overwrite)."""
    return {r["step"]: (r["loss"], r["grad_norm"], r["consumed_tokens"]) for r in metric_records(run_dir)}


def test_build_and_train_survive_kill_9(tmp_path):
    rng = random.Random(SEED)
    log = tmp_path / "log.txt"
    inputs = _write_inputs(tmp_path)
    data, run = tmp_path / "data", tmp_path / "run"
    build = [str(BIN / "datapipe"), "build", "--quiet", "--workers", "2"]
    port = ["--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}", "--nproc", "2"]
    fail = lambda: log.read_text()[-6000:]  # noqa: E731

    # uninterrupted reference: build, then train, at the paths the faulty runs use (configs record them)
    config = _build_config(tmp_path, inputs, data)
    train = [str(BIN / "train"), "launch", str(_train_config(tmp_path, run, data)), *port]
    assert run_killable(build + [str(config)], log) == 0, fail()
    reference_data = tree(str(data), BUILD_VOLATILE)
    assert any(k.endswith(".tar") for k in reference_data) and "manifest.json" in reference_data
    assert run_killable(train, log) == 0, fail()
    reference_run = tree(str(run), TRAIN_VOLATILE)
    reference_trace = _trace(run)
    assert sorted(reference_trace) == list(range(1, STEPS + 1))
    data.rename(tmp_path / "ref-data")
    run.rename(tmp_path / "ref-run")

    # the build, killed once in a stage drawn from the seed, then rerun
    stage = rng.choice(["scan", "exact", "buckets", "tokenizer", "tokenize", "validation"])
    marker = data / "_work" / "logs" / stage / "completions"
    killed = run_killable(build + [str(config)], log, kill_when=lambda: marker.exists() and any(marker.iterdir()))
    assert killed == "killed", f"the build finished before stage {stage} could be killed"
    assert not (data / "manifest.json").exists()
    assert run_killable(build + [str(config)], log) == 0, fail()
    assert differences(reference_data, tree(str(data), BUILD_VOLATILE)) == [], f"after a kill in stage {stage}"

    # training, killed at a step drawn from the seed, then while its last checkpoint is being written
    ckpt = run / "checkpoints"
    last = f".tmp-step_{STEPS:08d}"
    first = rng.randint(3, 9)
    assert run_killable(train, log, kill_when=lambda: max(_trace(run), default=0) >= first) == "killed"
    assert run_killable(train, log, kill_when=lambda: ckpt.exists() and last in os.listdir(ckpt)) == "killed", \
        "the last checkpoint's save was never seen in flight"
    assert (ckpt / last).is_dir()
    assert run_killable(train, log) == 0, fail()
    assert "resumed at step" in log.read_text()
    removed = [ln for ln in log.read_text().splitlines() if "stale temporary folder" in ln]
    assert removed and last in removed[-1], log.read_text()[-3000:]
    assert _trace(run) == reference_trace
    assert differences(reference_run, tree(str(run), TRAIN_VOLATILE)) == []
