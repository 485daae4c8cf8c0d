"""End to end under faults: `datapipe build` killed -9 once and `train launch` killed -9 twice (once while
a checkpoint is being written), at points drawn from a seed, give byte-identical shards and a
bit-identical loss trace compared with an uninterrupted build → train run."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import yaml
from testutil import free_port, metric_records, read_corpus, run_killable

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


def _dataset_files(root: Path) -> dict[str, bytes]:
    """Everything a trainer reads (shards, indexes, tokenizer, manifest); not logs or timing reports."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.relative_to(root).as_posix().startswith(("_work/", "rejects/", "dedup/"))
            and p.name != "build_report.json"}


def _trace(run_dir: Path) -> dict[int, tuple]:
    """step → (loss, grad_norm, consumed_tokens), the last record of each step (re-run steps overwrite)."""
    return {r["step"]: (r["loss"], r["grad_norm"], r["consumed_tokens"]) for r in metric_records(run_dir)}


def test_build_and_train_survive_kill_9(tmp_path):
    rng = random.Random(SEED)
    log = tmp_path / "log.txt"
    inputs = _write_inputs(tmp_path)
    ref_data, data = tmp_path / "ref-data", tmp_path / "data"
    build = [str(BIN / "datapipe"), "build", "--quiet", "--workers", "2"]
    port = ["--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}", "--nproc", "2"]
    fail = lambda: log.read_text()[-6000:]  # noqa: E731

    # uninterrupted reference: build (at the same output path as the faulty build: the path is part of
    # the recorded config), then train
    config = _build_config(tmp_path, inputs, data)
    assert run_killable(build + [str(config)], log) == 0, fail()
    reference_files = _dataset_files(data)
    data.rename(ref_data)
    assert any(k.endswith(".tar") for k in reference_files) and "manifest.json" in reference_files
    ref_run = tmp_path / "ref-run"
    assert run_killable([str(BIN / "train"), "launch", str(_train_config(tmp_path, ref_run, ref_data)), *port], log) == 0, fail()
    reference_trace = _trace(ref_run)
    assert sorted(reference_trace) == list(range(1, STEPS + 1))

    # the build, killed once in a stage drawn from the seed, then rerun
    stage = rng.choice(["scan", "exact", "buckets", "tokenizer", "tokenize", "validation"])
    marker = data / "_work" / "logs" / stage / "completions"
    killed = run_killable(build + [str(config)], log, kill_when=lambda: marker.exists() and any(marker.iterdir()))
    assert killed == "killed", f"the build finished before stage {stage} could be killed"
    assert not (data / "manifest.json").exists()
    assert run_killable(build + [str(config)], log) == 0, fail()
    assert _dataset_files(data) == reference_files, f"shards differ after a kill in stage {stage}"

    # training, killed at a step drawn from the seed, then again while a checkpoint is being written
    run = tmp_path / "run"
    train = [str(BIN / "train"), "launch", str(_train_config(tmp_path, run, data)), *port]
    ckpt = run / "checkpoints"
    writing = lambda: ckpt.exists() and any(n.startswith(".tmp-step") for n in os.listdir(ckpt))  # noqa: E731
    first, second = rng.randint(3, 6), rng.randint(9, 12)
    at_step = lambda k: max(_trace(run), default=0) >= k  # noqa: E731
    assert run_killable(train, log, kill_when=lambda: at_step(first)) == "killed"
    assert run_killable(train, log, kill_when=lambda: at_step(second) and writing()) == "killed", \
        "no checkpoint write was caught in flight"
    assert run_killable(train, log) == 0, fail()
    assert "resumed at step" in log.read_text()
    assert _trace(run) == reference_trace
    assert not [n for n in os.listdir(ckpt) if n.startswith(".tmp-")]
