"""Step time of pretrain, SFT and DPO on the demo model: this tree against an earlier revision, in one run.

Both trees train the demo's configs (configs/demo.yaml, demo-sft.yaml, demo-apo.yaml: the tiny model, TP=2
on two CPU processes) on the datasets and checkpoints of a finished `make demo` (DEMO_OUT), with
checkpoints and in-loop evaluation off. The earlier revision runs from a temporary `git worktree` with
the same interpreter; runs alternate ABBA per round; the figure is the median step time over the logged
steps after `--skip` warm-up steps, over all rounds.

    python tools/bench/bench_objectives.py --before REV [--after REV] [--demo-out demo-out] [--steps 30]
                                           [--skip 5] [--rounds 2] [--only sft] [--append docs/benchmarks-history.md]

`--after REV` times another revision (also from a worktree) instead of this tree: e.g. a refactor's own
commit against its parent, without what was merged since.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _newest(ckpt_dir: Path) -> Path:
    return ckpt_dir / (ckpt_dir / "latest").read_text().strip()


def runs(demo: Path) -> dict[str, list[str]]:
    """`train launch` arguments per objective, on the demo's datasets and checkpoints."""
    off = ["--set", "checkpoint.full_every=0", "--set", "checkpoint.incremental_every=0", "--set", "eval.every=0",
           "--set", "monitor.log_every=1", "--set", "monitor.tensorboard=false"]
    return {
        "pretrain": ["configs/demo.yaml", "--set", f"data.dataset={demo / 'data'}", *off],
        "sft": ["configs/demo-sft.yaml", "--init", str(_newest(demo / "mid" / "checkpoints")),
                "--set", f"data.dataset={demo / 'chat'}", "--set", "epochs=null", *off],
        "dpo": ["configs/demo-apo.yaml", "--init", str(_newest(demo / "sft" / "checkpoints")),
                "--set", f"data.dataset={demo / 'prefs'}", "--set", "epochs=null", *off],
    }


def step_times(tree: Path, args: list[str], work: Path, steps: int, skip: int) -> list[float]:
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "train.cli", "launch", *args, "--nproc", "2", "--set", f"run_dir={run_dir}",
           "--set", f"steps={steps}"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{tree}: {' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > skip]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision to compare against (e.g. the commit before a refactor)")
    ap.add_argument("--after", default=None, help="git revision to time instead of this tree")
    ap.add_argument("--demo-out", default="demo-out", help="a finished `make demo` output folder")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the timing")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="pretrain,sft,dpo", help="objectives to time (comma-separated)")
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    demo = Path(args.demo_out).resolve()
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", args.after or "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), rev], cwd=REPO, check=True,
                       capture_output=True)
        after = REPO
        if args.after:
            after = Path(tmp) / "after"
            subprocess.run(["git", "worktree", "add", "--detach", str(after), head], cwd=REPO, check=True,
                           capture_output=True)
        try:
            times: dict[tuple[str, str], list[float]] = {}
            per_round: dict[str, list[float]] = {}
            only = args.only.split(",")
            for rnd in range(args.rounds):
                for name, a in [(n, a) for n, a in runs(demo).items() if n in only]:
                    order = [("before", before), ("after", after)]
                    for side, tree in order if rnd % 2 == 0 else order[::-1]:
                        t = step_times(tree, a, Path(tmp), args.steps, args.skip)
                        times.setdefault((name, side), []).extend(t)
                        print(f"round {rnd} {name:8s} {side:6s} median {statistics.median(t) * 1e3:7.1f} ms/step",
                              flush=True)
                        per_round.setdefault(name, []).append(statistics.median(t))
        finally:
            for tree in {before, after} - {REPO}:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    lines = [f"| objective | {rev} ms/step | {head} ms/step | after / before | per round |", "|---|---|---|---|---|"]
    for name in only:
        b, a = statistics.median(times[(name, "before")]), statistics.median(times[(name, "after")])
        r = per_round[name]  # each round's (before, after) medians, in the order run
        rounds = ", ".join(f"{(r[i + 1] / r[i]) if i // 2 % 2 == 0 else (r[i] / r[i + 1]):.3f}"
                           for i in range(0, len(r), 2))
        lines.append(f"| {name} | {b * 1e3:.1f} | {a * 1e3:.1f} | {a / b:.3f} | {rounds} |")
    table = "\n".join(lines)
    print(table)
    if args.append:
        cmd = "python tools/bench/bench_objectives.py " + " ".join(sys.argv[1:])
        with open(args.append, "a") as f:
            f.write(f"\n## Step time per objective, before/after ({datetime.date.today()}, {platform.machine()}, "
                    f"{os.cpu_count()} cores)\n\n`{cmd}`: the demo's configs (tiny model, TP=2 on 2 CPU processes), "
                    f"{args.steps} steps per run, the first {args.skip} left out, {args.rounds} rounds alternating "
                    f"ABBA, median step time.\n\n{table}\n")


if __name__ == "__main__":
    main()
