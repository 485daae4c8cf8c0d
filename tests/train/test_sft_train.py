"""objective sft under real torchrun/gloo: the loss is normalised by the global count of loss tokens (so
micro-batch size does not change it), a PP=2 layout agrees (TP and DP share the pretraining path, covered by
test_train_parallel), epochs set the steps, and kill -9 resumes bit-identically."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from testutil import metric_records, run_killable, write_random_dataset

from tools.outtree import TRAIN_VOLATILE, differences, tree

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[2]


def _config(tmp: Path, name: str, dataset: str, **over) -> Path:
    cfg = {"run_dir": str(tmp / name), "steps": 4, "seed": 7, "objective": "sft", "model": {"preset": "tiny"},
           "data": {"dataset": dataset, "seq_len": 256, "seed": 3, "shuffle_window": 16},
           "parallel": {"global_batch_size": 8, "micro_batch_size": 2},
           "optim": {"lr": 1.0e-3, "warmup_steps": 1, "schedule": "wsd", "decay_fraction": 0.0},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 0, "incremental_every": 0}}
    for k, v in over.items():
        node = cfg
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(cfg: Path, log: Path, nproc: int = 1, kill_when=None):
    cmd = [str(BIN / "train"), "launch", str(cfg), "--nproc", str(nproc)]  # standalone: a free port
    return run_killable(cmd, log, kill_when=kill_when)


def _curve(run_dir: Path) -> np.ndarray:
    return np.array([[r["loss"], r["grad_norm"], r["loss_tokens"]] for r in metric_records(run_dir)])


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> str:
    """Documents of very different lengths, so micro-batches hold very different numbers of loss tokens."""
    root = str(tmp_path_factory.mktemp("sft") / "ds")
    write_random_dataset(root, {"chat": 90, "long": 20}, vocab_size=1000, seed=5)
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory, docs):
    tmp = tmp_path_factory.mktemp("ref")
    log = tmp / "log.txt"
    assert _run(_config(tmp, "mbs2", docs), log) == 0, log.read_text()[-4000:]
    return _curve(tmp / "mbs2")


@pytest.mark.parametrize("name,nproc,over", [
    ("mbs1", 1, {"parallel.micro_batch_size": 1}),
    ("mbs4", 1, {"parallel.micro_batch_size": 4}),
    ("pp2", 2, {"parallel.pp": 2, "parallel.micro_batch_size": 1}),
])
def test_loss_is_global_token_mean_for_any_layout(tmp_path, docs, reference, name, nproc, over):
    log = tmp_path / "log.txt"
    assert _run(_config(tmp_path, name, docs, **over), log, nproc) == 0, log.read_text()[-4000:]
    got = _curve(tmp_path / name)
    assert got.shape == reference.shape == (4, 3)
    assert len(set(reference[:, 2])) > 1  # loss tokens differ between steps: normalisation matters
    np.testing.assert_allclose(got, reference, rtol=2e-5)
    assert got[-1, 0] != got[0, 0]


def test_epochs_set_steps_and_kill_9_resumes_bit_identically(tmp_path, docs):
    from storage.loader import LoaderConfig
    from storage.loader.conversations import ConversationLoader

    log = tmp_path / "log.txt"
    with ConversationLoader(LoaderConfig(dataset=docs, seq_len=256, seed=3, shuffle_window=16), 1) as ld:
        steps = ld.rows_in_epochs(1.5) // 4  # the run crosses an epoch boundary after the kill
    over = {"epochs": 1.5, "parallel.global_batch_size": 4, "parallel.micro_batch_size": 1,
            "checkpoint.full_every": 3, "checkpoint.incremental_every": 0}
    ref = _config(tmp_path, "ref", docs, **over)
    assert _run(ref, log) == 0, log.read_text()[-4000:]
    trace = {r["step"]: (r["loss"], r["grad_norm"]) for r in metric_records(tmp_path / "ref")}
    assert sorted(trace) == list(range(1, steps + 1))  # epochs, not `steps: 4`, decided the length
    resolved = yaml.safe_load((tmp_path / "ref" / "config.yaml").read_text())
    assert resolved["steps"] == steps

    run = _config(tmp_path, "killed", docs, **over)
    done = lambda: any(r["step"] >= 5 for r in metric_records(tmp_path / "killed"))  # noqa: E731
    # killed once step 5 is logged and a checkpoint has committed (async: under load the commit of step 3 can
    # lag behind step 5, and a kill before it would leave nothing to resume from)
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    assert _run(run, log, kill_when=lambda: (tmp_path / "killed" / "metrics.jsonl").exists() and latest.exists()
                and done()) == "killed"
    assert _run(run, log) == 0, log.read_text()[-4000:]
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in metric_records(tmp_path / "killed")}
    assert got == trace  # bit-identical
    assert differences(tree(str(tmp_path / "ref"), TRAIN_VOLATILE), tree(str(tmp_path / "killed"), TRAIN_VOLATILE)) == []
    events = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume" for e in events)
