"""GPU check of issue 5 in one script: the 1.7b preset, bf16, one GPU — measured tokens/s, MFU and peak
memory vs `train estimate`, appended to docs/benchmarks-history.md.

    python tools/bench/bench_train_gpu.py [--preset 1.7b] [--steps 30] [--mbs 4] [--gbs 32] [--seq-len 4096]

Uses synthetic tokens (no dataset needed) and no checkpoints; skips the first `--log-every` steps (warm-up)
by reading the last metrics record. Exits 0 with a message when no CUDA device is present.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1.7b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--run-dir", default="/tmp/bench_train_gpu")
    ap.add_argument("--append", default=str(REPO / "docs" / "benchmarks-history.md"))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    sets = [f"model.preset={args.preset}", "precision=bf16", f"data.seq_len={args.seq_len}",
            f"parallel.micro_batch_size={args.mbs}", f"parallel.global_batch_size={args.gbs}",
            f"steps={args.steps}", f"monitor.log_every={args.log_every}", "debug.synthetic_data=true",
            "checkpoint.full_every=0", "checkpoint.incremental_every=0", f"run_dir={args.run_dir}",
            "optim.warmup_steps=5"]
    flags = [x for s in sets for x in ("--set", s)]
    est = subprocess.run([sys.executable, "-m", "train.cli", "estimate", "--preset", args.preset, "--gpus", "1",
                          *flags], capture_output=True, text=True, cwd=REPO, check=True).stdout
    print(est)
    rc = subprocess.call([sys.executable, "-m", "train.cli", "launch", "/dev/null", "--nproc", "1", *flags], cwd=REPO)
    if rc:
        print(f"train launch failed with {rc}")
        return rc
    recs = [json.loads(x) for x in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in recs if "loss" in r][-1]
    line = (f"measured: {last['tokens_per_s']:,.0f} tokens/s, MFU {100 * (last['mfu'] or 0):.1f} %, "
            f"peak allocated {last.get('peak_alloc_gib', 0):.1f} GiB, reserved {last.get('reserved_gib', 0):.1f} GiB"
            f" (steps {last['step'] - args.log_every + 1}–{last['step']})")
    print(line)
    if args.append:
        with open(args.append, "a") as f:
            f.write(f"\n## Trainer on one GPU: {args.preset}, bf16 ({datetime.date.today().isoformat()})\n\n"
                    f"Command: `python tools/bench/bench_train_gpu.py {' '.join(sys.argv[1:])}`. "
                    f"Device: {torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores.\n\n"
                    f"```\n{est.strip()}\n{line}\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
