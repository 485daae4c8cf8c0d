"""`objective: distill` under real torchrun at TP2 with a teacher of another shape (the shared tiny_hf
Hugging Face folder, imported at launch): with ce_weight 1 the student's losses are exactly plain
pretraining's on the same data, and the divergence to the teacher is logged beside (kd); with ce_weight 0
the divergence alone trains the student and falls; the teacher's top-k precomputed by `train teacher-cache`
gives the same kd and losses as the teacher run beside the student, and a
corrupt cache or a row it lacks is refused; a teacher with another vocabulary is refused with both sizes."""
from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

from storage import config as cfgmod
from storage.config import ConfigError
from testutil import free_port, run_killable

TRAIN = os.path.join(os.path.dirname(sys.executable), "train")


def _config(tmp_path, name: str, objective: str, teacher: str, ce_weight: float, **distill) -> dict:
    return {"run_dir": str(tmp_path / name), "steps": 2, "seed": 3, "objective": objective,
            "model": {"preset": "tiny", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2,
                      "ffn_hidden_size": 64, "vocab_size": 1024},
            "parallel": {"tp": 2, "micro_batch_size": 2, "global_batch_size": 4}, "data": {"seq_len": 32, "seed": 7},
            "debug": {"synthetic_data": True}, "monitor": {"log_every": 1, "tensorboard": False},
            "alerts": {"mfu_warn_below": 0.0, "comm_share_warn_above": 0.0},
            "checkpoint": {"full_every": 0, "incremental_every": 0},
            "distill": {"teacher": teacher, "loss": "jsd", "beta": 0.5, "temperature": 2.0, "ce_weight": ce_weight,
                        **distill}}


def _losses(tmp_path, cfg: dict, command: str = "launch") -> list[dict]:
    conf = tmp_path / f"{cfg['run_dir'].rsplit('/', 1)[-1]}.yaml"
    conf.write_text(yaml.safe_dump(cfg))
    log = tmp_path / (conf.stem + f".{command}.log")
    rc = run_killable([TRAIN, command, str(conf), "--nproc", "2", "--set",
                       f"launch.rdzv_endpoint=127.0.0.1:{free_port()}"], log, timeout=300)
    assert rc == 0, log.read_text()[-4000:]
    if command != "launch":
        return []
    return [r for r in map(json.loads, open(os.path.join(cfg["run_dir"], "metrics.jsonl"))) if "loss" in r]


@pytest.mark.slow
def test_distill_trains_at_tp2_its_ce_term_is_pretraining_and_another_vocabulary_is_refused(tiny_hf, tmp_path):
    from train.config import TrainConfig

    from train.objectives.teacher_cache import TeacherCache, TeacherCacheError

    hf = tiny_hf[0]  # a Hugging Face folder: imported into RUN_DIR/teacher at launch
    ce = _losses(tmp_path, _config(tmp_path, "ce", "distill", hf, 1.0, top_k=8))
    pre = _losses(tmp_path, _config(tmp_path, "pre", "pretrain", hf, 0.0))
    assert [r["loss"] for r in ce] == pytest.approx([r["loss"] for r in pre], rel=1e-5)
    assert ce[0]["loss"] == pytest.approx(ce[0]["ce"], rel=1e-6) and 0 < ce[0]["kd"] < ce[0]["ce"]
    # ce_weight 0: the divergence alone trains the student: at the last step (same batch, same start) it is
    # below an untrained student's (a detached kd term leaves it equal, a sign-flipped one raises it)
    fast = {"steps": 4, "optim": {"lr": 2e-3, "min_lr": 2e-3, "warmup_steps": 0, "schedule": "constant",
                                  "weight_decay": 0.0}}
    kd = _losses(tmp_path, {**_config(tmp_path, "kd", "distill", hf, 0.0, top_k=8, temperature=1.0), **fast})
    assert [r["loss"] for r in kd] == pytest.approx([r["kd"] for r in kd], rel=1e-6)
    still = {**fast, "optim": {**fast["optim"], "lr": 1e-12, "min_lr": 1e-12}}
    frozen = _losses(tmp_path, {**_config(tmp_path, "frozen", "distill", hf, 0.0, top_k=8, temperature=1.0), **still})
    trained, still = [r["kd"] for r in kd], [r["kd"] for r in frozen]
    assert trained[0] == still[0] and all(r["grad_norm"] > 0 for r in kd), (trained, still)
    assert sum(trained[1:]) < 0.995 * sum(still[1:]), (trained, still)  # same batches: the trained one is closer
    cached = {**_config(tmp_path, "cached", "distill", hf, 0.0, top_k=8, temperature=1.0, precomputed=True), **fast}
    _losses(tmp_path, cached, "teacher-cache")  # the teacher alone, then the run reads its top-k
    [folder] = (tmp_path / "cached" / "teacher").glob("*/cache.json")
    got = _losses(tmp_path, cached)
    assert [r["kd"] for r in got] == [r["kd"] for r in kd] and [r["loss"] for r in got] == [r["loss"] for r in kd]
    cache = TeacherCache(str(folder.parent), "cpu")
    assert len(cache.rows) == 4 * 4  # steps × global batch: every row the run read
    import torch

    with pytest.raises(TeacherCacheError, match="holds no teacher outputs for a row this run reads"):
        cache.outputs([torch.zeros(1, 33, dtype=torch.long)], varlen=False)
    values = folder.parent / "dp00000.values"
    data = bytearray(values.read_bytes())
    data[5] ^= 1
    values.write_bytes(bytes(data))
    with pytest.raises(TeacherCacheError, match="dp00000.values: sha256 mismatch"):
        TeacherCache(str(folder.parent), "cpu")
    imported = str(tmp_path / "ce" / "teacher")
    cfg = cfgmod.load(TrainConfig, None, [f"{k}={json.dumps(v)}" for k, v in {
        "objective": "distill", "debug.synthetic_data": True, "model.vocab_size": 512,
        "distill.teacher": imported, "run_dir": str(tmp_path / "r")}.items()])
    with pytest.raises(ConfigError, match="vocabulary of 1024 tokens, the student 512"):
        cfg.check_data()
    with pytest.raises(ConfigError, match="distill.teacher"):
        cfgmod.load(TrainConfig, None, ["objective=distill", "debug.synthetic_data=true"])
