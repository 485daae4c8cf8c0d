"""How `train ablate` schedules an ablation's steps (train.ablate): here (builds, then the runs `jobs` at a time,
then the evaluations, then the report), as one Slurm array task per run (`--task I`), as sbatch scripts
(`--slurm`: the array and a report job after it), as a plan (`--dry-run`), or the report alone (`--report`).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from storage import config as cfgmod
from train import ablate_report
from train.ablate import Ablation, AblationError, Run


def _pool(jobs: int, work: list[Callable[[], None]]) -> None:
    """Run `work` `jobs` at a time; the first failure is raised once all have ended."""
    if jobs <= 1:
        for w in work:
            w()
        return
    with ThreadPoolExecutor(jobs) as ex:
        futures = [ex.submit(w) for w in work]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def pending(ab: Ablation) -> tuple[list[Run], dict[str, list[Run]]]:
    """The runs to train and, per validation set (group), the runs to evaluate."""
    to_train = [r for r in ab.runs if ab.run_step(r) != ab.steps]
    return to_train, {g.name: [r for r in ab.runs if ab.result(g, r) is None] for g in ab.groups()}


def prepare(ab: Ablation, dry: bool) -> None:
    """The checks and builds every mode starts with; writes OUTPUT/ablation.yaml (the resolved config)."""
    if not dry:
        ab.out.mkdir(parents=True, exist_ok=True)
        cfgmod.save(ab.cfg, ab.out / "ablation.yaml")
    ab.builds(dry)
    ab.check_datasets()
    st = ab.state()
    ab.check_train_fp(st)
    ab.check_eval_fps(st, dry)
    if not dry:
        st["train"] = ab.train_fp()
        ab.save_state(st)


def execute(ab: Ablation, jobs: int = 1, dry: bool = False) -> ablate_report.Report | None:
    """Everything here: builds, runs (`jobs` at a time), evaluations, merged results, the report."""
    prepare(ab, dry)
    to_train, to_eval = pending(ab)
    for r in ab.runs:
        step = ab.run_step(r)
        state = ("trained" if step == ab.steps else f"would resume at step {step}" if step and dry
                 else "would train" if dry else f"resumes at step {step}" if step else "to train")
        evals = [g for g, rs in to_eval.items() if r in rs]
        ab.echo(f"[ablate] run {r.label}: {state}; " + (f"to evaluate on {', '.join(evals)}" if evals else "evaluated"))
    ab.echo(f"[ablate] {len(to_train)} of {len(ab.runs)} runs to train ({ab.steps} steps, {ab.run_tokens:,} tokens "
            f"each), {sum(map(len, to_eval.values()))} evaluations to make")
    if dry:
        return None
    threads = max(1, (os.cpu_count() or 1) // (jobs * (ab.cfg.nproc or 1)))
    _pool(jobs, [lambda r=r: ab.train_one(r, threads) for r in to_train])
    for g in ab.groups():
        runs = to_eval[g.name]
        chunks = [runs[i::jobs] for i in range(min(jobs, len(runs)))]
        _pool(jobs, [lambda c=c, g=g: ab.eval_some(g, c, threads) for c in chunks])
    return report(ab)


def run_task(ab: Ablation, index: int) -> None:
    """One Slurm array task: run `index` (variant-major order) trained, evaluated and merged."""
    if not 0 <= index < len(ab.runs):
        raise AblationError(f"--task {index}: there are {len(ab.runs)} runs (0 to {len(ab.runs) - 1})")
    st = ab.state()
    ab.check_train_fp(st)
    if st.get("train") != ab.train_fp() or any(st.get("eval", {}).get(g.name) != ab.eval_fp(g) for g in ab.groups()):
        raise AblationError(f"{ab.out}/state.json does not match this config: submit with `train ablate --slurm`")
    run = ab.runs[index]
    if ab.run_step(run) != ab.steps:
        ab.train_one(run)
    for g in ab.groups():
        if ab.result(g, run) is None:
            ab.eval_some(g, [run])
    ab.merge(run)


def report(ab: Ablation) -> ablate_report.Report:
    """Merge every evaluated run, print and write the table, the verdicts and the plots."""
    results = [rec for r in ab.runs if (rec := ab.merge(r)) is not None]
    rep = ablate_report.build_report(results, ab.variants, ab.baseline, ab.cfg.metrics, [r.label for r in ab.runs])
    paths = ablate_report.write_report(rep, results, ab.out, ab.header())
    ab.echo(rep.markdown(ab.header()))
    for line in rep.verdict_lines():
        ab.echo(line)
    ab.echo(f"[ablate] wrote {paths[0]}, {paths[1]}" + (f" and {len(paths) - 2} plots in {ab.out / 'plots'}"
                                                        if len(paths) > 2 else ""))
    return rep


def slurm(ab: Ablation, dry: bool) -> list[Path]:
    """Builds here (listed only with `dry`), then OUTPUT/slurm/ablate.sbatch (an array: one task per run not
    yet trained and evaluated) and OUTPUT/slurm/report.sbatch (after the array, whatever its outcome); both
    submitted unless `dry`. The sbatch settings are the train config's launch.slurm, one node per task."""
    from train.launch import sbatch_header, sbatch_prologue

    s = ab.tcfg.launch.slurm
    if s.nodes != 1:
        raise AblationError(f"key 'train': launch.slurm.nodes is {s.nodes}: each run of an ablation is one array "
                            "task on one node")
    prepare(ab, dry)
    if dry:  # the scripts are written all the same, from the config as it stands
        ab.out.mkdir(parents=True, exist_ok=True)
        cfgmod.save(ab.cfg, ab.out / "ablation.yaml")
    to_train, to_eval = pending(ab)
    todo = [i for i, r in enumerate(ab.runs) if r in to_train or any(r in rs for rs in to_eval.values())]
    d = ab.out / "slurm"
    (d / "logs").mkdir(parents=True, exist_ok=True)
    config = shlex.quote(str((ab.out / "ablation.yaml").resolve()))
    py = shlex.quote(sys.executable)
    scripts = []
    if todo:
        array = f"#SBATCH --array={','.join(map(str, todo))}" + (
            f"%{ab.cfg.slurm.max_parallel}" if ab.cfg.slurm.max_parallel else "")
        lines = sbatch_header(s, f"{d.resolve()}/logs/%A_%a.out", nodes=1, job_name=f"{s.job_name}-ablate")
        lines += [array, f"# task i is run i, variants × seeds: {', '.join(r.label for r in ab.runs)}"]
        lines += sbatch_prologue(s, os.getcwd())
        lines += ["export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}", "",
                  f'{py} -m train.cli ablate {config} --task "$SLURM_ARRAY_TASK_ID"', ""]
        scripts.append(d / "ablate.sbatch")
        scripts[0].write_text("\n".join(lines))
    rep = ["#!/bin/bash", f"#SBATCH --job-name={s.job_name}-ablate-report", "#SBATCH --ntasks=1",
           "#SBATCH --cpus-per-task=1", f"#SBATCH --time={ab.cfg.slurm.report_time}",
           f"#SBATCH --output={d.resolve()}/logs/report-%j.out"]
    rep += [f"#SBATCH --{k}={getattr(s, k)}" for k in ("partition", "account") if getattr(s, k)]
    rep += ["", "set -euo pipefail", f"cd {shlex.quote(str(Path.cwd()))}", *s.setup, "",
            f"{py} -m train.cli ablate {config} --report", ""]
    (d / "report.sbatch").write_text("\n".join(rep))
    scripts.append(d / "report.sbatch")
    ab.echo(f"[ablate] wrote {scripts[0]} ({len(todo)} array tasks of {len(ab.runs)} runs) and {scripts[1]}" if todo
            else f"[ablate] every run is trained and evaluated: no array; wrote {scripts[0]}")
    if dry:
        return scripts
    try:
        dep = []
        if todo:
            job = subprocess.run(["sbatch", "--parsable", str(scripts[0])], check=True, capture_output=True,
                                 text=True).stdout.strip().split(";")[0]
            dep = [f"--dependency=afterany:{job}"]
            ab.echo(f"[ablate] submitted array job {job}")
        job = subprocess.run(["sbatch", "--parsable", *dep, str(scripts[-1])], check=True, capture_output=True,
                             text=True).stdout.strip()
    except FileNotFoundError:
        raise AblationError("sbatch is not installed here: submit the scripts from a Slurm login node") from None
    except subprocess.CalledProcessError as e:
        raise AblationError(f"sbatch failed (exit status {e.returncode}): {e.stderr.strip()}") from None
    ab.echo(f"[ablate] submitted report job {job}")
    return scripts
