"""`make small-demo`: make the demo's model small, and measure what each step costs, on `make demo`'s outputs
(its dataset DEMO/data and pretraining run DEMO/run; run `make demo` first).

1. `train ckpt prune` the demo's pretrained model (the teacher) in width (Minitron: activation importance);
2. from the pruned checkpoint, the same student trained for `--steps` steps on the same tokens twice per seed:
   `objective: distill` (forward KL to the teacher) and `objective: pretrain` (plain cross entropy); each
   run's validation bits per byte after its last step;
3. `train ckpt quantize` the teacher (int8 and int4 weight-only) and the distilled student (int8);
4. one `train eval` table: teacher, pruned, pruned+distilled, pruned+CE and the quantized folders
   (validation loss and bpb, benchmarks, size on disk, generation tokens/s).

    python -m tools.small_demo [--demo demo-out] [--out demo-out/small] [--steps 100] [--seeds 1]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(title: str, cmd: list[str]) -> float:
    print(f"\n=== {title}\n$ {' '.join(map(str, cmd))}", flush=True)
    t = time.time()
    rc = subprocess.call([str(c) for c in cmd], cwd=REPO)
    if rc != 0:
        sys.exit(f"small-demo step failed ({title}): exit {rc}")
    return time.time() - t


def newest(root: Path) -> Path:
    ck = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    return ck / (ck / "latest").read_text().strip()


def student_run(out: Path, data: Path, init: Path, teacher: Path, objective: str, seed: int, steps: int) -> float:
    """One training run from the pruned checkpoint; returns its validation bpb after the last step."""
    run = out / f"{objective}-seed{seed}"
    cfg = {"run_dir": str(run), "steps": steps, "seed": seed, "objective": objective, "init": str(init),
           "parallel": {"tp": 1, "micro_batch_size": 4, "global_batch_size": 16},
           "data": {"dataset": str(data), "seq_len": 128, "seed": seed},
           "optim": {"lr": 2.0e-3, "min_lr": 2.0e-4, "warmup_steps": 10, "schedule": "cosine"},
           "monitor": {"log_every": 20}, "alerts": {"mfu_warn_below": 0.0, "comm_share_warn_above": 0.0},
           "checkpoint": {"full_every": steps, "incremental_every": 0, "async_save": False},
           "eval": {"every": steps, "validation_tokens": 8192, "tasks": []}}
    if objective == "distill":
        cfg["distill"] = {"teacher": str(teacher), "loss": "forward_kl", "temperature": 1.0}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{objective}-seed{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if run.exists():
        shutil.rmtree(run)
    sh(f"train launch ({objective}, seed {seed}): {steps} steps from the pruned checkpoint",
       [BIN / "train", "launch", path, "--nproc", "1"])
    evals = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"val/all/bpb"' in ln]
    return evals[-1]["val/all/bpb"]


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else float("nan"))


def run(demo: Path, out: Path, steps: int, seeds: int, width: str, limit: int) -> dict:
    data, teacher = demo / "data", newest(demo / "run")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    timings = {"prune_s": sh(f"1/4 train ckpt prune --width {width}: Minitron importance on 256 calibration "
                             "sequences", [BIN / "train", "ckpt", "prune", teacher, out / "pruned", "--width", width])}
    pruned = newest(out / "pruned")
    bpb = {"distill": [], "pretrain": []}
    for seed in range(seeds):
        for objective in ("distill", "pretrain"):
            bpb[objective].append(student_run(out / "runs", data, pruned, teacher, objective, 1000 + seed, steps))
    distilled = newest(out / "runs" / "distill-seed1000")
    ce = newest(out / "runs" / "pretrain-seed1000")
    quant = {"teacher-int8": (teacher, "int8-weight"), "teacher-int4": (teacher, "int4-weight"),
             "distilled-int8": (distilled, "int8-weight")}
    for name, (src, scheme) in quant.items():
        timings[f"quantize_{name}_s"] = sh(f"3/4 train ckpt quantize {scheme} ({name})",
                                           [BIN / "train", "ckpt", "quantize", src, out / "quant" / name,
                                            "--scheme", scheme])
    table = out / "eval"
    common = ["--config", demo / "run" / "config.yaml", "--set", f"data.dataset={data}", "--tasks",
              "arc_easy,piqa,sciq", "--limit", str(limit), "--set", "eval.generation.speed_prompts=4",
              "--set", "eval.generation.speed_new_tokens=32", "--out", table]
    sh("4/4 train eval: teacher, pruned, pruned+distilled, pruned+CE (validation bpb, benchmarks, size, "
       "generation tokens/s)", [BIN / "train", "eval", f"teacher={teacher}", f"pruned={pruned}",
                                f"pruned+distilled={distilled}", f"pruned+CE={ce}", *common])
    for name in quant:
        sh(f"train eval --hf {name}", [BIN / "train", "eval", "--hf", f"{name}={out / 'quant' / name}", *common])
    text = subprocess.run([BIN / "train", "eval", "--table", table], capture_output=True, text=True,
                          cwd=REPO).stdout
    print(text)
    recs = {json.loads(p.read_text())["label"]: json.loads(p.read_text())["metrics"] for p in table.glob("*.json")}
    diffs = [c - d for c, d in zip(bpb["pretrain"], bpb["distill"])]
    return {"bpb": bpb, "diff": mean_se(diffs), "distill": mean_se(bpb["distill"]), "ce": mean_se(bpb["pretrain"]),
            "table": text, "records": recs, "timings": timings, "teacher": str(teacher), "width": width,
            "steps": steps, "seeds": seeds}


def summary(res: dict) -> str:
    d, s = res["diff"]
    lines = [f"validation bpb after {res['steps']} steps from the pruned checkpoint, {res['seeds']} seed(s):",
             f"  distilled (forward KL): {res['distill'][0]:.4f} ± {res['distill'][1]:.4f} "
             f"(per seed {', '.join(f'{x:.4f}' for x in res['bpb']['distill'])})",
             f"  plain cross entropy:    {res['ce'][0]:.4f} ± {res['ce'][1]:.4f} "
             f"(per seed {', '.join(f'{x:.4f}' for x in res['bpb']['pretrain'])})",
             f"  CE − distilled, paired per seed: {d:.4f} ± {s:.4f}"
             + (f" ({d / s:.1f} standard errors)" if s == s and s > 0 else "")]
    r = res["records"]
    for a, b in (("teacher-int8", "teacher"), ("teacher-int4", "teacher"), ("distilled-int8", "pruned+distilled")):
        if a in r and b in r:
            x, y = r[a]["val/all/bpb"], r[b]["val/all/bpb"]
            lines.append(f"  {a}: validation bpb {x:.4f} vs {y:.4f} ({100 * (x - y) / y:+.2f} %), size "
                         f"{r[a]['size_bytes'] / 2**20:.2f} vs {r[b]['size_bytes'] / 2**20:.2f} MiB")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default="demo-out", help="`make demo`'s output folder")
    ap.add_argument("--out", default=None, help="default: DEMO/small")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--width", default="hidden=96,ffn=256,heads=2")
    ap.add_argument("--limit", type=int, default=100, help="items per benchmark")
    args = ap.parse_args()
    demo = (REPO / args.demo).resolve()
    if not (demo / "run" / "checkpoints").is_dir() or not (demo / "data" / "manifest.json").is_file():
        sys.exit(f"{demo}: no demo outputs (run/checkpoints, data/); run `make demo` first")
    t0 = time.time()
    res = run(demo, Path(args.out).resolve() if args.out else demo / "small", args.steps, args.seeds, args.width,
              args.limit)
    print(summary(res))
    print(f"\nDone in {time.time() - t0:.0f} s; outputs in {args.out or demo / 'small'}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
