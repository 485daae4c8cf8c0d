"""Batch-size ramp-up (`parallel.batch_rampup`, train.rampup): each step takes the next sequences of the
loader's global order (DP ranks interleaved by micro-batch), and a `train launch` run stopped in the middle of
a ramp and relaunched equals the uninterrupted run bit for bit, with the LR and the metrics following each
step's own batch. The ramp: global batch 2 → 8 by 2 over 12 sequences of 32 tokens: steps of 2, 2, 4, 6, 8, 8."""
from __future__ import annotations

import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from storage import config as cfgmod
from testutil import free_port, metric_records, run_killable, write_random_dataset
from train.config import TrainConfig

TRAIN = os.path.join(os.path.dirname(sys.executable), "train")
SEQ, SIZES = 32, [2, 2, 4, 6, 8, 8]
RAMP = {"global_batch_size": 8, "batch_rampup": {"start": 2, "increment": 2, "over_tokens": 12 * SEQ}}


def _config(tmp_path, name: str, dataset: str, **over) -> str:
    cfg = {"run_dir": str(tmp_path / name), "steps": 6, "seed": 5, "data": {"dataset": dataset, "seq_len": SEQ},
           "model": {"preset": "tiny", "hidden_size": 64, "num_layers": 2, "ffn_hidden_size": 96},
           "parallel": {"micro_batch_size": 2, **RAMP}, "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 0, "incremental_every": 0, "async_save": False}, **over}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _launch(path: str, log, *sets: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    rc = run_killable([TRAIN, "launch", path, "--nproc", "1", *args, "--set",
                       f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], log, timeout=300)
    assert rc == 0, open(log).read()[-5000:]


def test_ramp_steps_take_the_loaders_sequences_in_order(tmp_path):
    """At DP 2 with micro-batches of 1, rank r's rows of a step are every other sequence of the step's span."""
    from storage.loader.loader import TokenLoader
    from train.data import make_loader
    from train.rampup import BatchSizes

    root = str(tmp_path / "ds")
    write_random_dataset(root, {"web": 20}, vocab_size=256)
    cfg = cfgmod.from_dict(TrainConfig, {"data": {"dataset": root, "seq_len": SEQ},
                                         "parallel": {"micro_batch_size": 1, **RAMP}})
    sizes = BatchSizes(cfg.parallel, SEQ, dp=2)
    ranks = [make_loader(cfg, SimpleNamespace(dp=2, dp_rank=r, device=torch.device("cpu"))) for r in (0, 1)]
    with TokenLoader(cfg.data, global_batch_size=sum(SIZES)) as ref:
        want = next(ref)  # sequences 0 .. 29 of the global order
    consumed = 0
    try:
        for b in SIZES:
            assert sizes.at(consumed) == b
            rows = [sizes.take(ld, b) for ld in ranks]
            assert [r.shape for r in rows] == [(b // 2, SEQ + 1)] * 2
            assert torch.equal(torch.stack(rows, 1).reshape(b, SEQ + 1), want[consumed:consumed + b])
            consumed += b
    finally:
        for ld in ranks:
            ld.close()
    assert [ld.state_dict()["consumed"] for ld in ranks] == [sum(SIZES)] * 2  # the resume position


@pytest.mark.slow
def test_resume_mid_ramp_equals_the_uninterrupted_run(tmp_path):
    """A run dir holding only the straight run's step-3 checkpoint (what a run stopped or killed there after
    that save leaves: 2 + 2 + 4 of the 12 ramp sequences consumed) resumes into steps 4-6 bit for bit."""
    from train.checkpoint.export_hf import load_model_tensors
    from train.optim import lr_at

    root = str(tmp_path / "ds")
    write_random_dataset(root, {"web": 20}, vocab_size=256)
    straight = _config(tmp_path, "straight", root)
    _launch(straight, tmp_path / "straight.log", "checkpoint.full_every=3")
    mid = tmp_path / "straight" / "checkpoints" / "step_00000003"
    shutil.copytree(mid, tmp_path / "resumed" / "checkpoints" / mid.name)
    _launch(_config(tmp_path, "resumed", root), tmp_path / "resumed.log")
    events = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume" and e["step"] == 3 for e in events)

    a, b = metric_records(tmp_path / "straight"), metric_records(tmp_path / "resumed")
    keys = ("step", "loss", "grad_norm", "lr", "global_batch_size", "consumed_tokens")
    assert [[r[k] for k in keys] for r in b] == [[r[k] for k in keys] for r in a[3:]]  # bit for bit
    ckpts = [tmp_path / run / "checkpoints" / "step_00000006" for run in ("straight", "resumed")]
    (wa, _), (wb, _) = (load_model_tensors(str(c)) for c in ckpts)
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [torch.load(c / "train_state.pt", weights_only=False)["loader"]["consumed"] for c in ckpts] == [30, 30]

    # each step's own batch: sizes, tokens seen and tokens/s, and the LR on sequences (over 30 / 8 batches)
    assert [r["global_batch_size"] for r in a] == SIZES
    seen = [sum(SIZES[:i + 1]) for i in range(6)]
    assert [r["consumed_tokens"] for r in a] == [n * SEQ for n in seen]
    for r, n in zip(a, SIZES):
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(n * SEQ)
    o = cfgmod.load(TrainConfig, straight).optim
    assert [r["lr"] for r in a] == [lr_at(n / 8 - 1, o, 30 / 8) for n in seen]
