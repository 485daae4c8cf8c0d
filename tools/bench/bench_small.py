"""Distillation vs plain cross entropy, and the cost of quantization, on the demo's model (issue 31): runs
`tools/small_demo.py` with several seeds on `make demo`'s outputs and appends the figures to
docs/benchmarks-history.md.

    python tools/bench/bench_small.py [--demo demo-out] [--steps 100] [--seeds 3] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools import small_demo  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--demo", default="demo-out")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    demo = (REPO / args.demo).resolve()
    res = small_demo.run(demo, demo / "small-bench", args.steps, args.seeds, "hidden=96,ffn=256,heads=2", args.limit)
    text = "\n".join([
        f"## Make it small: pruning, distillation, quantization on the demo model ({datetime.date.today()}, "
        f"{platform.machine()}, {os.cpu_count()} cores)", "",
        f"Command: `python tools/bench/bench_small.py --steps {args.steps} --seeds {args.seeds} --limit {args.limit}` "
        f"on `make demo`'s outputs (teacher: the pretrained tiny model, {Path(res['teacher']).name}). The student "
        f"is the teacher pruned with `train ckpt prune --width {res['width']}`; per seed it is trained twice from "
        "the same pruned weights on the same tokens (global batch 16 × 128, lr 2e-3 cosine): `objective: distill` "
        "(forward KL, T 1) and `objective: pretrain`. Benchmarks: 100 items each; generation: 4 prompts × 32 "
        "greedy tokens, batch 1, transformers on CPU (2 shared cores: tokens/s are noisy).", "",
        "```", small_demo.summary(res), "", res["table"].rstrip(), "```", ""])
    print(text)
    if not args.no_write:
        with open(REPO / "docs" / "benchmarks-history.md", "a") as f:
            f.write("\n" + text)
        print("appended to docs/benchmarks-history.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
