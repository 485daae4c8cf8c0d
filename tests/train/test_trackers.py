"""Experiment trackers (train.monitor.trackers) with the real packages in their local modes: an offline W&B run
folder (its .wandb record file read back) and an MLflow store in SQLite hold every metric of metrics.jsonl at
the same steps (training records, evaluation records and the eval table); a kill -9 + resume through
`train launch` continues the same W&B and MLflow runs; a tracker that fails costs one warning line and no
record; a tracker that hangs never holds the caller."""
from __future__ import annotations

import glob
import json
import os
import struct
import sys
import threading

import pytest
import yaml
from testutil import metric_records, run_killable

from train.config import MonitorConfig, MlflowConfig, WandbConfig
from train.monitor import trackers
from train.monitor.metrics import Sinks

TRAIN = os.path.join(os.path.dirname(sys.executable), "train")


def wandb_history(root) -> tuple[set, dict, dict]:
    """(run ids, {step: {key: value}} merged over every offline run folder under root, the config) from the
    runs' .wandb files: wandb's LevelDB-style log of protobuf records (32 KiB blocks, 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    ids, steps, config = set(), {}, {}
    for path in sorted(glob.glob(f"{root}/wandb/offline-run-*/run-*.wandb")):
        data, pos, buf = open(path, "rb").read(), 7, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                break
            chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
            buf = chunk if kind in (1, 2) else buf + chunk
            if kind not in (1, 4):
                continue
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "run":
                ids.add(rec.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
            elif rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                steps.setdefault(items["_step"], {}).update(items)
    return ids, steps, config


def mlflow_runs(uri: str, experiment: str = "smoltrain"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id])


def expected(run_dir) -> dict:
    """{(step, key): [values]} of metrics.jsonl as the trackers name them. After a resume a step between the
    checkpoint and the kill has two records: the same loss, other timings; a tracker holds one of them."""
    out: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            items = {f"train/{k}": v for k, v in r.items() if k not in ("step", "time")}
        elif r.get("kind") == "eval":
            items = {k if "/" in k else f"eval/{k}": v for k, v in r.items()
                     if k not in ("step", "time", "consumed_tokens")}
        else:
            continue
        for k, v in items.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault((r["step"], k), []).append(v)
    return out


def assert_trackers_hold(run_dir, wb_root, uri) -> tuple:
    want = expected(run_dir)
    ids, hist, config = wandb_history(wb_root)
    got = {(s, k): v for s, items in hist.items() for k, v in items.items() if not k.startswith("_")}
    wrong = [(k, got.get(k), v) for k, v in want.items() if got.get(k) not in v]
    assert not wrong, wrong[:5]
    client, runs = mlflow_runs(uri)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    held = {}
    for key in {k for _, k in want}:
        for m in client.get_metric_history(run.info.run_id, key):
            held.setdefault((m.step, key), []).append(m.value)
    wrong = [(k, held.get(k), v) for k, v in want.items() if held.get(k) is None or len(held[k]) != 1
             or not any(held[k][0] == pytest.approx(x, rel=1e-12) for x in v)]
    assert not wrong, wrong[:5]  # every step once
    return ids, config, client, run


def _monitor(tmp_path):
    return MonitorConfig(tensorboard=False,
                         wandb=WandbConfig(enabled=True, mode="offline", dir=str(tmp_path / "wb")),
                         mlflow=MlflowConfig(enabled=True, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"))


def _rec(step):
    return {"step": step, "loss": 5.0 - 0.1 * step, "grad_norm": 1.0 + step / 7, "lr": 1e-3, "tokens_per_s": 1000.0,
            "step_time_s": 0.5, "data_wait_share": 0.01, "mfu": None, "rss_gib": 0.5, "mem_fraction": 0.1,
            "skipped_steps": 0}


def test_sinks_send_every_metric_and_the_eval_table_to_both_trackers(tmp_path, capsys):
    run_dir = tmp_path / "run"
    s = Sinks(run_dir, _monitor(tmp_path), config={"model": {"preset": "tiny"}, "steps": 3})
    for step in (1, 2, 3):
        s.log(_rec(step))
    s.log_eval(3, 3000, {"val/all/loss": 4.25, "val/all/ppl": 70.1, "val/all/bpb": 1.5, "eval/hellaswag/acc_norm": 0.3125,
                    "eval_time_s": 1.5})
    s.close(3)
    assert "warning" not in capsys.readouterr().err
    ids, config, client, run = assert_trackers_hold(run_dir, tmp_path / "wb", f"sqlite:///{tmp_path}/mlflow.db")
    state = json.loads((run_dir / "trackers.json").read_text())
    assert ids == {state["wandb"]["id"]} and run.info.run_id == state["mlflow"]["run_id"]
    assert config["model"] == {"preset": "tiny"} and run.data.params["model.preset"] == "tiny"
    assert run.info.status == "FINISHED"
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert arts == {"plots/metrics.png", "plots/eval.png"}, arts
    table = json.loads(open(client.download_artifacts(run.info.run_id, "eval_table/step_00000003.json")).read())
    assert ["eval/hellaswag/acc_norm", 0.3125] in table["rows"]
    _, hist, _ = wandb_history(tmp_path / "wb")
    assert hist[3]["plots/metrics/_type"] == "image-file" and hist[3]["plots/eval/_type"] == "image-file"
    files = glob.glob(f"{tmp_path}/wb/wandb/offline-run-*/files")[0]
    table = json.loads(open(f"{files}/{hist[3]['eval_table/path']}").read())
    assert table["columns"] == ["metric", "value"] and ["eval/hellaswag/acc_norm", 0.3125] in table["data"]


def test_a_failing_tracker_costs_one_warning_line_and_no_record(tmp_path, capsys, monkeypatch):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if mlflow-skinny were not installed
    s = Sinks(tmp_path / "run", MonitorConfig(
        tensorboard=False, wandb=WandbConfig(enabled=True, mode="offline", dir=str(tmp_path / "not-a-dir" / "x")),
        mlflow=MlflowConfig(enabled=True)))
    for step in range(1, 6):
        s.log(_rec(step))
    s.close(5)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "logging is off" in ln]
    assert len(lines) == 2, err
    assert any("W&B" in ln and "not-a-dir" in ln for ln in lines), lines
    assert any("MLflow" in ln and "mlflow-skinny package is not installed" in ln for ln in lines), lines
    assert [r["step"] for r in metric_records(tmp_path / "run")] == [1, 2, 3, 4, 5]
    events = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"event"' in ln]
    assert len(events) == 2 and all(e["event"] == "warning" for e in events)


def test_a_hanging_tracker_never_holds_the_caller(tmp_path):
    release = threading.Event()

    class Hanging(trackers._Worker):
        name = "hanging"
        start = staticmethod(lambda: release.wait(60))
        log = staticmethod(lambda metrics, step: None)
        finish = staticmethod(lambda: None)

    w = Hanging(None, tmp_path, {})
    for step in range(1000):  # a direct call would wait 60 s on the first one
        w.submit(w.log, {"loss": 1.0}, step)
    assert not release.is_set() and w._q.qsize() >= 999
    release.set()
    w.close(timeout=30)
    assert not w._thread.is_alive() and not w.warnings


@pytest.mark.slow
def test_kill_9_and_resume_continue_the_same_tracker_runs(tmp_path):
    run_dir, wb = tmp_path / "run", tmp_path / "wb"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # far more steps than the test runs: the kill waits for both trackers to have started (MLflow's import and
    # database set-up take seconds beside the training), and the relaunch stops cleanly (stop_at) soon after
    cfg = {"run_dir": str(run_dir), "steps": 1000, "seed": 1234, "model": {"preset": "tiny"},
           "parallel": {"micro_batch_size": 2, "global_batch_size": 2},
           "data": {"seq_len": 32, "seed": 7}, "debug": {"synthetic_data": True},
           "monitor": {"log_every": 1, "tensorboard": False,
                       "wandb": {"enabled": True, "mode": "offline", "dir": str(wb)},
                       "mlflow": {"enabled": True, "tracking_uri": uri}},
           "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 5, "incremental_every": 0, "keep_last": 2, "keep_full_every": 0}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "log"
    cmd = [TRAIN, "launch", str(path), "--nproc", "1"]
    ckpt = run_dir / "checkpoints"
    state = run_dir / "trackers.json"

    def started() -> bool:  # both tracker runs exist, a checkpoint is committed, a step after it was logged
        saved = [int(p.name[5:]) for p in ckpt.glob("step_*")] if ckpt.exists() else []
        return state.exists() and "mlflow" in state.read_text() and bool(saved) \
            and metric_records(run_dir)[-1]["step"] > max(saved)
    killed = run_killable(cmd, log, kill_when=started)
    assert killed == "killed", killed
    first = json.loads((run_dir / "trackers.json").read_text())
    stop = metric_records(run_dir)[-1]["step"] + 5
    assert run_killable(cmd + ["--set", f"stop_at={stop}"], log) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "resumed at step" in text and "logging is off" not in text, text[-3000:]
    assert metric_records(run_dir)[-1]["step"] == stop
    assert json.loads((run_dir / "trackers.json").read_text()) == first
    ids, config, client, run = assert_trackers_hold(run_dir, wb, uri)
    assert ids == {first["wandb"]["id"]} and len(glob.glob(f"{wb}/wandb/offline-run-*")) == 2
    assert run.info.run_id == first["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert config["model"]["preset"] == "tiny" and config["steps"] == 1000 and config["stop_at"] == stop
