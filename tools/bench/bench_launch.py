"""Wall time of a short `train launch`, start-up and exit included: this tree against an earlier revision and
against the floor of any megatron-core launch, in one run.

- ours: `train launch configs/demo.yaml --nproc 2` (the tiny model, TP=2 on two CPU processes) on synthetic
  data, --steps steps, the demo's async full checkpoint at the end, in-loop evaluation off; the whole command
  timed from outside, as a user waits for it.
- before (`--before REV`): the same command from a temporary `git worktree` at REV, same interpreter.
- floor: `python -m torch.distributed.run --nproc-per-node=2 --standalone` of a script that imports megatron
  through train.model.cpu_compat (as every rank does), joins a gloo process group and leaves it: what any
  megatron-core launch on this machine pays before and after its work.
Sides take turns within each round, their order rotated per round; medians over --rounds.

    python tools/bench/bench_launch.py [--before REV] [--rounds 5] [--steps 2] [--append docs/benchmarks-history.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_FLOOR = """
from train.model import cpu_compat
cpu_compat.install()
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{cwd}: {' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def launch_cmd(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "train.cli", "launch", "configs/demo.yaml", "--nproc", "2",
            "--set", f"run_dir={run_dir}", "--set", f"steps={steps}", "--set", "debug.synthetic_data=true",
            "--set", "data.dataset=", "--set", "model.vocab_size=4096", "--set", "eval.every=0",
            "--set", "eval.tasks=[]", "--set", f"checkpoint.full_every={steps}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = {"ours": REPO}
        if args.before:
            rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=REPO, capture_output=True,
                                 text=True, check=True).stdout.strip()
            trees["before"] = work / "before"
            subprocess.run(["git", "worktree", "add", "--detach", str(trees["before"]), rev], cwd=REPO, check=True,
                           capture_output=True)
        (work / "floor.py").write_text(_FLOOR)
        sides = ["floor", *trees]
        times: dict[str, list[float]] = {s: [] for s in sides}
        try:
            for r in range(args.rounds):
                for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                    tree = trees.get(side, REPO)
                    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
                    if side == "floor":
                        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                               str(work / "floor.py")]
                    else:
                        run_dir = work / f"run-{side}"
                        shutil.rmtree(run_dir, ignore_errors=True)
                        cmd = launch_cmd(run_dir, args.steps)
                    times[side].append(timed(cmd, tree, env))
                print(f"round {r + 1}: " + ", ".join(f"{s} {times[s][-1]:.2f} s" for s in sides), flush=True)
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees["before"])], cwd=REPO,
                               capture_output=True)
    med = {s: statistics.median(v) for s, v in times.items()}
    label = {"ours": f"ours ({head})", "before": f"before ({args.before})", "floor": "floor (torchrun + megatron import + gloo)"}
    lines = ["| launch | median s | runs | / floor |", "|---|---|---|---|"]
    lines += [f"| {label[s]} | {med[s]:.2f} | {', '.join(f'{t:.2f}' for t in times[s])} | {med[s] / med['floor']:.2f} |"
              for s in sides]
    table = "\n".join(lines)
    print(table)
    if args.append:
        cmd = "python tools/bench/bench_launch.py " + " ".join(sys.argv[1:])
        with open(args.append, "a") as f:
            f.write(f"\n## `train launch` wall time, start-up and exit included ({datetime.date.today()}, "
                    f"{platform.machine()}, {os.cpu_count()} cores)\n\n`{cmd}`: configs/demo.yaml (tiny model, TP=2 "
                    f"over 2 CPU processes), synthetic data, {args.steps} steps, an async full checkpoint at the end, "
                    f"in-loop evaluation off; each command timed whole from outside; sides take turns, medians of "
                    f"{args.rounds} rounds.\n\n{table}\n")


if __name__ == "__main__":
    main()
