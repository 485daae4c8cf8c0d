"""Kill trials: runs killed with SIGKILL at random points and rerun to the end must leave the output tree of
an uninterrupted run, file by file and hidden files included (tools.outtree; its short list of files
whose bytes hold times is compared in normalized form or not at all).

- build: `datapipe build` with no config (the embedded demo corpus), `--workers 2`;
- train: `train launch` of the tiny model with TP=2 on two CPU processes (gloo), async full checkpoints
  every 6 steps and incremental ones every 2 (keep_last 3), on the demo dataset.

The uninterrupted run is made three times: its trees must agree (else the comparison would prove
nothing), and the median of the three wall times is the run's length. Each trial starts from an empty
output folder, kills the run (the process group and every descendant, as a machine failure would) at a
point drawn from the seed, reruns the same command to the end and compares trees. Kill points are spread
over the whole run: trial k of n is killed at a fraction f of the run's length, f drawn in [k/n, (k+1)/n)
(so the last tenth gets its share; `--train-window steps`: of the training run from its first step on,
start-up excluded); a run that finished before its kill is retried with f lowered by 5 %,
so every trial is a real kill. It prints one line per trial (where the kill landed: the stage or the step,
a checkpoint save in flight, the leftovers the rerun removed) and a summary, and with `--report` appends
that summary as markdown. Run it alone on the machine (`flock`): the kill points are times.

    python -m tools.kill_trials [--build 50] [--train 20] [--seed 34] [--train-window run|steps]
                                [--work /tmp/kill-trials] [--report docs/kill-trials.md]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

from tools.outtree import BUILD_VOLATILE, TRAIN_VOLATILE, differences, tree

BIN = Path(sys.executable).parent
STALE = re.compile(r"removed (\d+) stale temporary (file|folder)s?(?: and (\d+) stale temporary folders?)?")
STEPS = 100


@dataclass
class Trial:
    kind: str
    k: int
    f: float  # kill point: fraction of the reference run's wall time
    where: str = ""
    removed: int = 0  # stale temporary files/folders the rerun reported
    diff: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.diff


def kill_tree(pid: int) -> None:
    """SIGKILL the process, its group and every descendant (found first: torchrun's workers have sessions
    of their own)."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def run(cmd: list[str], log: Path, kill_after: float | None = None, probe=None,
        started=None) -> tuple[int | str, float, str]:
    """Run cmd (its own session, output appended to `log`); with kill_after, SIGKILL it after that many
    seconds. Returns (exit status or "killed", seconds, what `probe()` said at the kill); with `started`,
    the third item is instead the seconds until started() first held (a run's start-up)."""
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        up = None
        try:
            while p.poll() is None:
                if kill_after is not None and time.monotonic() - t0 >= kill_after:
                    seen = probe() if probe else ""
                    kill_tree(p.pid)
                    rc = p.wait()
                    return ("killed" if rc == -signal.SIGKILL else rc), time.monotonic() - t0, seen
                if started is not None and up is None and started():
                    up = time.monotonic() - t0
                time.sleep(0.005)
            return p.returncode, time.monotonic() - t0, up
        finally:
            kill_tree(p.pid)  # leftovers of the group (megatron's helper processes)


def stale_removed(log_text: str) -> int:
    n = 0
    for m in STALE.finditer(log_text):
        n += int(m.group(1)) + int(m.group(3) or 0)
    return n


def rerun_and_compare(trial: Trial, cmd: list[str], out: Path, log: Path, ref: dict, volatile) -> None:
    start = log.stat().st_size if log.exists() else 0
    rc, _, _ = run(cmd, log)
    text = log.read_text()[start:]
    if rc != 0:
        trial.diff = [f"rerun failed (exit status {rc}): {text[-1500:]}"]
        return
    trial.removed = stale_removed(text)
    trial.diff = differences(ref, tree(str(out), volatile))


def reference(cmd: list[str], out: Path, log: Path, volatile, fresh, started=None) -> tuple[dict, float, float]:
    """Three uninterrupted runs: their common tree (they must agree), the median wall time and the median
    start-up (until `started()` first held; 0 without it)."""
    trees, times, ups = [], [], []
    for _ in range(3):
        fresh()
        rc, secs, up = run(cmd, log, started=started)
        assert rc == 0, f"uninterrupted run failed (exit status {rc}); see {log}"
        trees.append(tree(str(out), volatile))
        times.append(secs)
        ups.append(up or 0.0)
    for t in trees[1:]:
        assert not differences(trees[0], t), f"two uninterrupted runs differ: {differences(trees[0], t)}"
    return trees[0], sorted(times)[1], sorted(ups)[1]


def killed_run(trial: Trial, cmd: list[str], ref_seconds: float, log: Path, probe, fresh) -> None:
    """Kill `cmd` at trial.f of the reference's wall time; lower f by 5 % until the kill lands in the run."""
    while True:
        fresh()
        rc, secs, seen = run(cmd, log, kill_after=trial.f * ref_seconds, probe=probe)
        if rc == "killed":
            trial.where = seen
            return
        if rc != 0:
            raise RuntimeError(f"{trial.kind} trial {trial.k}: the run failed (exit status {rc}); see {log}")
        trial.f *= 0.95


# -- build ---------------------------------------------------------------------------------------------
def build_stage(out: Path) -> str:
    """The stage a build is in: the last one with a task log, and whether a shard was being written."""
    logs = out / "_work" / "logs"
    stages = sorted(logs.iterdir(), key=lambda p: p.stat().st_mtime) if logs.is_dir() else []
    where = stages[-1].name if stages else "start"
    writing = [p.name for p in out.rglob(".tmp-*")]
    return where + (f" (writing {', '.join(sorted(writing)[:2])})" if writing else "")


def build_trials(n: int, rng: random.Random, work: Path, log: Path) -> tuple[list[Trial], float, Path]:
    out = work / "build" / "ds"
    cmd = [str(BIN / "datapipe"), "build", "--quiet", "--workers", "2", "--set", f"output={out}"]
    shutil.rmtree(work / "build", ignore_errors=True)
    ref, ref_s, _ = reference(cmd, out, log, BUILD_VOLATILE, lambda: shutil.rmtree(out, ignore_errors=True))
    dataset = work / "dataset"
    shutil.rmtree(dataset, ignore_errors=True)
    shutil.copytree(out, dataset)
    print(f"build: 3 uninterrupted runs agree, median {ref_s:.1f} s, {len(ref)} files compared", flush=True)
    trials = []
    for k in range(n):
        t = Trial("build", k, (k + rng.random()) / n)
        t0 = time.monotonic()
        killed_run(t, cmd, ref_s, log, lambda: build_stage(out), lambda: shutil.rmtree(out, ignore_errors=True))
        rerun_and_compare(t, cmd, out, log, ref, BUILD_VOLATILE)
        t.seconds = time.monotonic() - t0
        trials.append(t)
        print(line(t), flush=True)
    return trials, ref_s, dataset


# -- train ---------------------------------------------------------------------------------------------
def train_config(path: Path, run_dir: Path, dataset: Path) -> None:
    cfg = {"run_dir": str(run_dir), "steps": STEPS, "seed": 1234, "precision": "fp32", "model": {"preset": "tiny"},
           "parallel": {"tp": 2, "micro_batch_size": 2, "global_batch_size": 4},
           "data": {"dataset": str(dataset), "seq_len": 64, "seed": 7},
           "optim": {"lr": 1.0e-3, "min_lr": 1.0e-4, "warmup_steps": 2, "schedule": "wsd"},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"async_save": True, "full_every": 6, "incremental_every": 2, "keep_last": 3,
                          "keep_full_every": 0}}
    path.write_text(yaml.safe_dump(cfg))


def train_progress(run_dir: Path) -> str:
    steps = 0
    metrics = run_dir / "metrics.jsonl"
    for ln in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            steps = max(steps, json.loads(ln).get("step", 0) if "loss" in ln else 0)
        except json.JSONDecodeError:
            pass
    ckpt = run_dir / "checkpoints"
    saving = sorted(n for n in os.listdir(ckpt) if n.startswith(".tmp-step")) if ckpt.is_dir() else []
    return (f"after step {steps}" if steps else "start-up") + (f", saving {saving[0][5:]}" if saving else "")


def train_trials(n: int, rng: random.Random, work: Path, dataset: Path, log: Path,
                 window: str) -> tuple[list[Trial], float, float]:
    run_dir, cfg = work / "train" / "run", work / "train" / "train.yaml"
    shutil.rmtree(work / "train", ignore_errors=True)
    cfg.parent.mkdir(parents=True)
    train_config(cfg, run_dir, dataset)
    cmd = [str(BIN / "train"), "launch", str(cfg), "--nproc", "2"]
    metrics = run_dir / "metrics.jsonl"
    ref, ref_s, up_s = reference(cmd, run_dir, log, TRAIN_VOLATILE, lambda: shutil.rmtree(run_dir, ignore_errors=True),
                                 started=lambda: metrics.exists() and metrics.stat().st_size > 0)
    print(f"train: 3 uninterrupted runs agree, median {ref_s:.1f} s (start-up {up_s:.1f} s), {len(ref)} files "
          "compared", flush=True)
    lo = up_s / ref_s if window == "steps" else 0.0  # kill points over the whole run, or from its first step on
    trials = []
    for k in range(n):
        t = Trial("train", k, lo + (1 - lo) * (k + rng.random()) / n)
        t0 = time.monotonic()
        killed_run(t, cmd, ref_s, log, lambda: train_progress(run_dir),
                   lambda: shutil.rmtree(run_dir, ignore_errors=True))
        rerun_and_compare(t, cmd, run_dir, log, ref, TRAIN_VOLATILE)
        t.seconds = time.monotonic() - t0
        trials.append(t)
        print(line(t), flush=True)
    return trials, ref_s, up_s


# -- report --------------------------------------------------------------------------------------------
def line(t: Trial) -> str:
    verdict = "identical" if t.ok else "DIFFERENT: " + "; ".join(t.diff[:5])
    return (f"{t.kind} trial {t.k + 1:2d}: killed at {100 * t.f:5.1f}% ({t.where}); rerun removed {t.removed} "
            f"stale temporary file(s); tree {verdict}")


def landed(t: Trial) -> str:
    """Where a kill landed, coarsely: the build's stage, or start-up / training / after the last step."""
    if t.kind == "build":
        return t.where.split(" ")[0]
    if t.where.startswith("start-up"):
        return "start-up"
    return "after the last step" if t.where.startswith(f"after step {STEPS}") else "training"


def summary(trials: list[Trial], ref_s: float, what: str) -> list[str]:
    ok = sum(t.ok for t in trials)
    last = [t for t in trials if t.f >= 0.9]
    removed = [t for t in trials if t.removed]
    where = Counter(landed(t) for t in trials)
    saving = sum("saving" in t.where for t in trials)
    return [f"- {what}: **{ok}/{len(trials)} identical** (uninterrupted run {ref_s:.0f} s); kill points from "
            f"{100 * min(t.f for t in trials):.1f}% to {100 * max(t.f for t in trials):.1f}% of the run, "
            f"{len(last)} in its last 10%; landed in {', '.join(f'{k} {v}' for k, v in where.items())}"
            + (f" ({saving} while a checkpoint save was in flight)" if trials[0].kind == "train" else "")
            + f"; {len(removed)} reruns found and removed leftovers of the killed run "
            f"({sum(t.removed for t in removed)} stale temporary files and folders in all)"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=int, default=50, help="build trials")
    ap.add_argument("--train", type=int, default=20, help="training trials")
    ap.add_argument("--seed", type=int, default=34, help="draws the kill points")
    ap.add_argument("--work", default="/tmp/kill-trials", help="scratch folder (removed first)")
    ap.add_argument("--train-window", choices=["run", "steps"], default="run",
                    help="training kill points over the whole run, or from its first step on (start-up excluded)")
    ap.add_argument("--report", default=None, help="append the summary (markdown) to this file")
    a = ap.parse_args(argv)
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "trials.log"
    log.write_text("")
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    builds, build_s, dataset = build_trials(a.build, rng, work, log)
    trains, train_s, up_s = train_trials(a.train, rng, work, dataset, log, a.train_window) if a.train \
        else ([], 0.0, 0.0)
    lines = summary(builds, build_s, "`datapipe build` (demo corpus, `--workers 2`)") if builds else []
    if trains:
        window = f"from its first step on (start-up {up_s:.0f} s)" if a.train_window == "steps" else "over the whole run"
        lines += summary(trains, train_s, f"`train launch` (tiny, TP=2 on 2 CPU processes, {STEPS} steps, async "
                                          f"full checkpoints every 6 steps + incremental every 2; kill points {window})")
    cmd = "python -m tools.kill_trials " + " ".join(argv if argv is not None else sys.argv[1:])
    print("\n".join(["", *lines, f"total {time.monotonic() - t0:.0f} s"]))
    if a.report:  # appended, as tools/bench/ scripts append to docs/benchmarks-history.md
        body = [f"## {time.strftime('%Y-%m-%d')}: `{cmd.strip()}`", "",
                f"{os.cpu_count()} CPUs, {(time.monotonic() - t0) / 60:.0f} min in all.", "", *lines, "",
                "Per trial:", "", "```", *[line(t) for t in builds + trains], "```", "", ""]
        with open(a.report, "a") as f:
            f.write("\n".join(body))
    return 0 if all(t.ok for t in builds + trains) else 1


if __name__ == "__main__":
    raise SystemExit(main())
