"""Run a build's stages on Slurm: one array job per stage, chained with `afterok` dependencies.

`submit` writes each sbatch script to `WORK/slurm/NN.sbatch` (and the `sbatch` command line beside it) and
submits it; with `dry_run` nothing is submitted. The jobs run the python that runs the build (or
`slurm.venv_path`'s) as `python -m datatrove.tools...`, with the submitting shell's environment
(PYTHONPATH included: datatrove submits with `--export=ALL`), so they need no activated venv on the nodes.
With `wait` the driver polls `squeue` until the chain has ended; a failed task cancels the jobs that would
wait forever on it, and the chain is resubmitted up to `slurm.retries` times (finished tasks are skipped
through their completion markers), else each failed task is reported with its log and logged exception.
The ids of the submitted jobs are kept in `WORK/slurm/jobs.json`: a rerun (after the driver was killed,
say) first cancels those still queued or running, so two tasks never write the same outputs at once.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable

from datatrove.executor import slurm as dt_slurm

from datapipe.executorconfig import ExecutorConfig, SlurmSettings
from datapipe.executors import quiet_datatrove
from storage import atomic

POLL_S = 2.0
# squeue states of a job that may still run (PENDING counts unless its dependency can never be satisfied)
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
          "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED"}
NEVER = "DependencyNeverSatisfied"


class SlurmStage(dt_slurm.SlurmPipelineExecutor):
    """datatrove's Slurm executor, with two changes: its tasks run through one python rather than the
    `launch_pickled_pipeline` first on the nodes' PATH, and no job per stage merges the tasks' stats into
    `stats.json` (one more job, and a CPU, per stage; the per-task stats stay in `logs/<stage>/stats/`)."""

    def __init__(self, *args, python: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.python = python

    def get_launch_file_contents(self, sbatch_args: dict, run_script: str) -> str:
        run_script = run_script.replace(" launch_pickled_pipeline ",
                                        f" {shlex.quote(self.python)} -m datatrove.tools.launch_pickled_pipeline ")
        return super().get_launch_file_contents(sbatch_args, run_script)

    def launch_merge_stats(self) -> None:
        pass


def _python(s: SlurmSettings) -> tuple[str, str | None]:
    """The python of the jobs and the activate script they source (None: no venv to activate)."""
    if not s.venv_path:
        return sys.executable, None
    activate = s.venv_path if os.path.isfile(s.venv_path) else os.path.join(s.venv_path, "bin", "activate")
    return os.path.join(os.path.dirname(activate), "python"), activate


def _chain(s: SlurmSettings, stages: list, work: str) -> SlurmStage:
    python, activate = _python(s)
    prev = None
    for st in stages:
        prev = SlurmStage(
            st.pipeline, tasks=st.tasks, time=s.time, partition=s.partition, cpus_per_task=s.cpus_per_task,
            mem_per_cpu_gb=s.mem_per_cpu_gb, job_name=f"{s.job_name}-{st.name}", python=python,
            env_command=f"source {shlex.quote(activate)}" if activate else None,
            sbatch_args=dict(s.sbatch_args) or None, logging_dir=os.path.join(work, "logs", st.name),
            slurm_logs_folder=os.path.join(work, "slurm", "logs", st.name), depends=prev, skip_completed=True)
    return prev


def _launch(s: SlurmSettings, stages: list, work: str, dry_run: bool, jobs: dict[str, str],
            scripts: list[str]) -> None:
    """Submit (with dry_run only write) the chain; adds its jobs (id → stage) and sbatch scripts."""
    out_dir = os.path.join(work, "slurm")
    real_launch = dt_slurm.launch_slurm_job

    def launch(contents: str, job_id_retriever: Callable, *args) -> str:
        path = os.path.join(out_dir, f"{len(scripts):02d}.sbatch")
        atomic.write_bytes(path, contents.encode())
        # the sbatch command line with its --dependency
        atomic.write_bytes(path + ".cmd", (" ".join(["sbatch", *args, path]) + "\n").encode())
        scripts.append(path)
        if dry_run:
            job_id = str(1000 + len(scripts))
        else:
            res = subprocess.run(["sbatch", *args, path], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"sbatch {path} failed: {(res.stderr or res.stdout).strip()}")
            job_id = job_id_retriever(res.stdout)
        jobs[job_id] = re.search(r"^#SBATCH --job-name=\S*-(\w+)$", contents, re.M).group(1)
        return job_id

    chain = _chain(s, stages, work)
    dt_slurm.launch_slurm_job = launch
    try:
        with quiet_datatrove():
            chain.run()
    except BaseException:
        if not dry_run:  # a later sbatch failed: the jobs already queued would wait on nothing
            _cancel(list(jobs))
        raise
    finally:
        dt_slurm.launch_slurm_job = real_launch


def _squeue(ids) -> list[tuple[str, str, str, str]]:
    """(job id, array index, state, reason) of every task of the given jobs Slurm still knows about."""
    ids = set(ids)
    for attempt in range(5):  # a busy slurmctld times out now and then
        res = subprocess.run(["squeue", "--me", "-h", "-r", "--states=all", "-o", "%F|%K|%T|%r"],
                             capture_output=True, text=True)
        if res.returncode == 0:
            rows = [tuple(line.split("|", 3)) for line in res.stdout.splitlines() if line.count("|") == 3]
            return [r for r in rows if r[0] in ids]
        time.sleep(POLL_S * (attempt + 1))
    raise RuntimeError(f"squeue failed: {res.stderr.strip()}")


def _is_active(row) -> bool:
    return row[2] in ACTIVE and row[3] != NEVER


def _cancel(ids) -> None:
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True)


def _wait_gone(ids) -> None:
    while any(_is_active(r) for r in _squeue(ids)):
        time.sleep(POLL_S)


def _cancel_previous(jobs_file: str) -> None:
    """Cancel what an earlier submission of this build left queued or running, and wait until it is gone."""
    if not os.path.exists(jobs_file):
        return
    with open(jobs_file) as f:
        alive = sorted({r[0] for r in _squeue(json.load(f)) if r[2] in ACTIVE})
    if alive:
        _say(f"slurm: cancelling jobs {', '.join(alive)} left by an earlier submission of this build")
        _cancel(alive)
        _wait_gone(alive)


def _wait(jobs: dict[str, str], work: str, progress: bool) -> list[str]:
    """Poll until no job of the chain can run any more; return a line per failed task."""
    failed: dict[tuple[str, str], str] = {}
    cancelled: set[str] = set()
    done: set[str] = set()
    while True:
        rows = _squeue(jobs)
        for job, idx, state, _ in rows:
            if state not in ACTIVE and state != "COMPLETED" and job not in cancelled and (job, idx) not in failed:
                failed[job, idx] = _describe(jobs[job], job, idx, state, work)
        for job, stage in jobs.items():
            states = [r[2] for r in rows if r[0] == job]
            if stage not in done and states and set(states) == {"COMPLETED"}:
                done.add(stage)
                if progress:
                    _say(f"slurm: stage {stage} done")
        if failed or any(r[3] == NEVER for r in rows):  # the rest of the chain can never start: cancel it
            pending = sorted({r[0] for r in rows if r[2] == "PENDING"} - cancelled)
            _cancel(pending)
            cancelled.update(pending)
        if not any(_is_active(r) for r in rows if r[0] not in cancelled):
            _wait_gone(cancelled)  # a task cancelled as it started may still be stopping
            return list(failed.values())
        time.sleep(POLL_S)


def _describe(stage: str, job: str, idx: str, state: str, work: str) -> str:
    """One line on a failed task: its state, its log, and the exception it logged (else the log's last line)."""
    logfile = os.path.join(work, "slurm", "logs", stage, f"{job}_{idx}.out")
    lines = []
    if os.path.exists(logfile):
        with open(logfile, errors="replace") as f:
            lines = [re.sub(r"^\d+: ", "", line.strip()) for line in f if line.strip()]  # srun -l's prefix
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)]
    cause = (errors or lines or [""])[-1]
    return f"stage {stage}, job {job} task {idx}: {state.lower()} (log {logfile})" + (f": {cause}" if cause else "")


def submit(ex: ExecutorConfig, stages: list, work: str, dry_run: bool = False, progress: bool = True) -> list[str]:
    """Submit the stages as a job chain (see the module doc); returns the sbatch scripts written. With
    `ex.slurm.wait`, returns once every stage has completed (printing a line per stage with `progress`),
    or raises RuntimeError naming the failed tasks."""
    s = ex.slurm
    out_dir = os.path.join(work, "slurm")
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.endswith((".sbatch", ".sbatch.cmd")):
            os.remove(os.path.join(out_dir, name))
    scripts: list[str] = []
    if dry_run:
        _launch(s, stages, work, True, {}, scripts)
        return scripts
    jobs_file = os.path.join(out_dir, "jobs.json")
    _cancel_previous(jobs_file)
    for attempt in range(s.retries + 1):
        jobs: dict[str, str] = {}
        try:
            _launch(s, stages, work, False, jobs, scripts)
        finally:
            atomic.write_bytes(jobs_file, json.dumps(jobs, indent=1).encode())
        if not s.wait:
            return scripts
        failed = _wait(jobs, work, progress)
        missing = [st.name for st in stages if _incomplete(work, st)]
        if not missing:
            return scripts
        report = "\n  ".join(failed or [f"the jobs ended with stage {missing[0]} incomplete"])
        if attempt < s.retries:
            _say(f"slurm: tasks failed, resubmitting (retry {attempt + 1}/{s.retries}):\n  {report}")
    raise RuntimeError(f"the Slurm build failed ({s.retries + 1} submission(s)):\n  {report}")


def stage_end(logging_dir: str, tasks: int) -> float:
    """When a finished stage's last task completed (its completion marker's mtime)."""
    done = os.path.join(logging_dir, "completions")
    return max((os.path.getmtime(os.path.join(done, f"{r:05d}")) for r in range(tasks)
                if os.path.exists(os.path.join(done, f"{r:05d}"))), default=0.0)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _incomplete(work: str, stage) -> bool:
    done = os.path.join(work, "logs", stage.name, "completions")
    return any(not os.path.exists(os.path.join(done, f"{r:05d}")) for r in range(stage.tasks))
