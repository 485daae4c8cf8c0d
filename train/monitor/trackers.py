"""Experiment trackers beside JSONL and TensorBoard: Weights & Biases (`monitor.wandb`) and MLflow
(`monitor.mlflow`).

Each tracker runs on its own thread behind a queue, so a slow or unreachable tracker never holds a training
step: the trainer only enqueues. The first failure of a tracker (package missing, a directory it cannot
write, a server that is down) turns it off and leaves one warning, which the sinks print and write to
metrics.jsonl on the trainer's thread; training goes on. One tracker run per training run: its id is kept in
RUN_DIR/trackers.json, so a resumed run (after a crash or a kill -9) continues the same W&B run and the same
MLflow run. Rank 0 only (the sinks are off elsewhere).

Metric names are those of metrics.jsonl: a training record's fields under `train/` (as in TensorBoard), an
evaluation's keys as they are (`val/...`, `eval/<task>/...`). W&B keeps one value per step: steps that a
resumed run logs again (those after its checkpoint) are dropped by W&B as already logged, and a bit-exact
resume logs the same values there. MLflow keeps both.
"""
from __future__ import annotations

import json
import os
import queue
import re
import secrets
import threading
import time
from pathlib import Path

from storage import atomic

STATE_FILE = "trackers.json"
_STOP = object()


def _state(run_dir: Path) -> dict:
    p = run_dir / STATE_FILE
    return json.loads(p.read_text()) if p.exists() else {}


def _save_state(run_dir: Path, key: str, value: dict) -> None:
    state = _state(run_dir)
    state[key] = value
    atomic.write_bytes(str(run_dir / STATE_FILE), json.dumps(state, indent=1, sort_keys=True).encode())


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: the resolved config as MLflow parameters."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _numbers(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def train_metrics(rec: dict) -> dict:
    """A training record's fields as the trackers name them (train/<field>, as in TensorBoard)."""
    return _numbers({f"train/{k}": v for k, v in rec.items() if k not in ("step", "time")})


def eval_metrics(metrics: dict) -> dict:
    """An evaluation record's keys as the trackers name them (`val/...`, `eval/<task>/...`, eval/<other>)."""
    return _numbers({k if "/" in k else f"eval/{k}": v for k, v in metrics.items()
                     if k not in ("step", "time", "consumed_tokens", "kind")})


def read_records(path: Path, end: int) -> list[tuple[int, dict]]:
    """(step, metrics) of metrics.jsonl's first `end` bytes (a killed run's cut last line is skipped)."""
    out = []
    with open(path, "rb") as f:
        data = f.read(end)
    for line in data.splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r:
            out.append((r["step"], train_metrics(r)))
        elif r.get("kind") == "eval":
            out.append((r["step"], eval_metrics(r)))
    return out


class _Worker:
    """One tracker's thread: calls run in order; the first exception turns the tracker off.

    A resumed run first sends what metrics.jsonl held before this process (`history`: path and length) and
    the tracker does not (the records a kill lost on their way), then skips those steps when the run logs
    them again (a bit-exact resume logs the same values)."""

    name = "tracker"

    def __init__(self, cfg, run_dir: Path, config: dict, history: tuple[Path, int] | None = None,
                 maxsize: int = 100_000):
        self.cfg, self.run_dir, self.config, self.history = cfg, run_dir, config, history  # cfg: its config section
        self.warnings: list[str] = []   # read and cleared by the trainer's thread
        self.dropped = 0
        self.replayed_through = -1      # steps up to this one came from metrics.jsonl at the start
        self._q: queue.Queue = queue.Queue(maxsize)
        self._dead = False
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-tracker", daemon=True)
        self._thread.start()
        self.submit(self._start_and_replay)

    def _start_and_replay(self) -> None:
        self.start()
        if not self.history or not self.history[1]:
            return
        records = read_records(*self.history)
        held = self.held_step()
        for step, metrics in records:
            if step > held:
                self.log(metrics, step)
        self.replayed_through = max(step for step, _ in records) if records else -1

    def send(self, metrics: dict, step: int) -> None:
        if step > self.replayed_through:
            self.log(metrics, step)

    def submit(self, fn, *args) -> None:
        if self._dead:
            return
        try:
            self._q.put_nowait((fn, args))
        except queue.Full:  # the tracker is far behind: the records stay in metrics.jsonl
            if not self.dropped:
                self.warnings.append(f"{self.name}: queue full, dropping records until it catches up "
                                     "(metrics.jsonl keeps them)")
            self.dropped += 1

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            fn, args = item
            if self._dead:
                continue
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - any tracker failure: one warning, training goes on
                self._dead = True
                self.warnings.append(f"{self.name} logging is off for this run: {type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else ''} (metrics.jsonl and "
                                     "TensorBoard are unaffected)")

    def close(self, timeout: float = 120.0) -> None:
        self.submit(self.finish)
        self._q.put(_STOP)
        self._thread.join(timeout)

    # each tracker: start, held_step (the last step it holds after start), log(metrics, step),
    # table(name, rows, step), images(paths, step), finish
    def start(self) -> None:
        raise NotImplementedError


def _require(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"the {package} package is not installed (pip install {package})") from None


class WandbTracker(_Worker):
    name = "W&B"

    def start(self) -> None:
        # a service inherited from the process that launched us (a notebook, a test) may still hold the
        # stream of this run's killed predecessor ("run ID is in use"): this run gets its own
        os.environ.pop("WANDB_SERVICE", None)
        wandb = _require("wandb", "wandb")
        c = self.cfg
        state = _state(self.run_dir).get("wandb")
        if state is None:  # the id is kept before the run starts: a kill right after still resumes it
            state = {"id": secrets.token_hex(4), "project": c.project}
            _save_state(self.run_dir, "wandb", state)
        root = Path(c.dir or self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=c.project, entity=c.entity or None, name=c.name or self.run_dir.name,
                              id=state["id"], resume="allow", dir=str(root), mode=c.mode, tags=c.tags or None,
                              config=self.config,
                              settings=wandb.Settings(x_disable_stats=True, console="off", save_code=False,
                                                      silent=True, init_timeout=c.init_timeout_s))
        self._wandb = wandb

    def held_step(self) -> int:
        return self.run.step - 1  # the next step W&B expects (0 for a new run and for an offline one)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def table(self, name: str, rows: list[list], step: int) -> None:
        if step > self.replayed_through:
            self.run.log({name: self._wandb.Table(columns=["metric", "value"], data=rows)}, step=step)

    def images(self, paths: list[Path], step: int) -> None:
        self.run.log({f"plots/{p.stem}": self._wandb.Image(str(p)) for p in paths}, step=step)

    def finish(self) -> None:
        self.run.finish()


_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


def _create_sqlite_store(uri: str, client_cls) -> None:
    """A new SQLite store is set up under a temporary name and renamed when complete: a kill during MLflow's
    schema migrations would leave a half-made database that every later run fails on."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///"):])
    if path.exists():
        return
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    client_cls(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # runs the migrations
    os.replace(tmp, path)


class MlflowTracker(_Worker):
    name = "MLflow"

    def start(self) -> None:
        _require("mlflow", "mlflow-skinny")
        import logging

        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their INFO lines (database set-up) on the training console
            logging.getLogger(name).setLevel(logging.WARNING)

        c = self.cfg
        uri = c.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"
        _create_sqlite_store(uri, MlflowClient)
        self.client = client = MlflowClient(tracking_uri=uri)
        state = _state(self.run_dir).get("mlflow")
        if state and state.get("tracking_uri") == uri:
            self.run_id = state["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            client.log_dict(self.run_id, self.config, f"config-resumed-{int(time.time())}.json")
            return
        exp = client.get_experiment_by_name(c.experiment)
        # a SQLite store's artifacts go beside it (MLflow's default is ./mlruns under whatever directory
        # the run was started from)
        where = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri() \
            if uri.startswith("sqlite:///") else None
        exp_id = exp.experiment_id if exp else client.create_experiment(c.experiment, artifact_location=where)
        run = client.create_run(exp_id, run_name=c.run_name or self.run_dir.name,
                                tags={"run_dir": str(self.run_dir.resolve())})
        self.run_id = run.info.run_id
        _save_state(self.run_dir, "mlflow", {"run_id": self.run_id, "tracking_uri": uri, "experiment_id": exp_id})
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in sorted(flatten(self.config).items())]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            client.log_batch(self.run_id, params=params[i:i + 100])
        client.log_dict(self.run_id, self.config, "config.json")

    def held_step(self) -> int:
        return max((m.step for m in self.client.get_metric_history(self.run_id, "train/loss")), default=-1)

    def log(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(_MLFLOW_KEY.sub("_", k), float(v), ts, step) for k, v in metrics.items()]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def table(self, name: str, rows: list[list], step: int) -> None:
        self.client.log_dict(self.run_id, {"step": step, "rows": rows}, f"{name}/step_{step:08d}.json")

    def images(self, paths: list[Path], step: int) -> None:
        for p in paths:
            self.client.log_artifact(self.run_id, str(p), "plots")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


class Trackers:
    """The configured trackers of one run; every call only enqueues. `history`: metrics.jsonl and its length
    before this process appended to it (a resumed run's records so far)."""

    def __init__(self, monitor_cfg, run_dir: Path, config: dict, history: tuple[Path, int] | None = None):
        self.workers: list[_Worker] = []
        if monitor_cfg.wandb.enabled:
            self.workers.append(WandbTracker(monitor_cfg.wandb, run_dir, config, history))
        if monitor_cfg.mlflow.enabled:
            self.workers.append(MlflowTracker(monitor_cfg.mlflow, run_dir, config, history))

    def log_train(self, rec: dict) -> None:
        metrics = train_metrics(rec)
        for w in self.workers:
            w.submit(w.send, metrics, rec["step"])

    def log_eval(self, step: int, metrics: dict) -> None:
        named = eval_metrics(metrics)
        rows = [[k, v] for k, v in sorted(named.items())]
        for w in self.workers:
            w.submit(w.send, named, step)
            w.submit(w.table, "eval_table", rows, step)

    def images(self, paths: list[Path], step: int) -> None:
        for w in self.workers:
            w.submit(w.images, paths, step)

    def warnings(self) -> list[str]:
        out = []
        for w in self.workers:
            while w.warnings:  # appended on the tracker's thread
                out.append(w.warnings.pop(0))
        return out

    def close(self) -> None:
        for w in self.workers:
            w.close()
