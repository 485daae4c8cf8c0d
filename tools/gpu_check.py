"""Every GPU-only measurement of the project in one run, under 8 minutes on one GPU (issue 19):

- train        tokens/s, MFU and peak memory of the 135m, 360m and 1.7b presets in bf16, recompute off and
               (when the model config has `recompute`) selective: short `train launch` runs on synthetic
               tokens, each against `train estimate`'s prediction (the largest micro-batch whose predicted
               memory fits 80 % of the GPU; fused attention counted when Transformer Engine is installed);
- checkpoint   the final full save of each training run, written to --dir (put it on local NVMe): bytes,
               training stall, time until committed;
- loader_cuda  the streaming loader's CUDA path (pinned host buffers + side stream) vs its CPU batches;
- dali         the loader with DALI's reader (backend: dali) delivering batches on the GPU;
- gds          GPUDirect Storage reads through kvikio (storage.bench.gds) into device memory;
- nccl         all-reduce bus bandwidth over every GPU of the machine (skipped with one GPU).

Each part has its own time budget and is skipped with the reason when its dependency is missing (or when
the overall budget is spent). Results go to --json (default DIR/gpu_check.json) and replace the section
between the gpu_check markers of docs/benchmarks.md (--no-docs: not). Without a CUDA GPU it prints
"no CUDA GPU: nothing to measure" and exits 0. `--plan` (any machine, no GPU needed) writes the training
configs and validates each with `train launch --dry-run`, measuring nothing.

    python -m tools.gpu_check [--dir /nvme/gpu_check] [--budget 470] [--parts train,checkpoint,...]
                              [--json PATH] [--no-docs] [--plan [--gpu-gib 139]]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

from tools import gpu_check_parts as parts

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
PARTS = [  # (name, function, seconds): 470 s in all, under 8 minutes with start-up
    ("train", parts.train, 360),
    ("checkpoint", parts.checkpoint, 5),
    ("loader_cuda", parts.loader_cuda, 25),
    ("dali", parts.dali, 25),
    ("gds", parts.gds, 25),
    ("nccl", parts.nccl, 30),
]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_part(fn, ctx: dict, seconds: float) -> dict:
    """Run one part with a hard limit (SIGALRM, 20 s past its budget): ok, skipped (why) or failed (error)."""
    t0 = time.time()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(seconds) + 20)
    try:
        out = {"status": "ok", "results": fn(ctx, seconds)}
    except parts.Skip as e:
        out = {"status": "skipped", "reason": str(e)}
    except _Timeout:
        out = {"status": "failed", "reason": f"over its {seconds:.0f} s budget"}
    except Exception as e:  # noqa: BLE001 - one failed part must not lose the others' figures
        traceback.print_exc()
        out = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def validate_plan(root: Path, gpu_gib: float) -> list[str]:
    """Write the training configs and run `train launch --dry-run` on each (in process); the errors."""
    from click.testing import CliRunner

    from train.cli import main as train_cli

    runs = parts.plan(root, gpu_gib, parts.te_installed())
    parts.write_configs(runs)
    errors = []
    for r in runs:
        res = CliRunner().invoke(train_cli, [*r["cmd"], "--dry-run"])
        print(f"{r['name']}: micro-batch {r['mbs']}: train {' '.join(r['cmd'])} --dry-run → exit {res.exit_code}")
        if res.exit_code != 0:
            errors.append(f"{r['name']}: {res.output.strip()[-500:]}")
    print("nccl: " + " ".join(parts.nccl_command(2, root / "nccl.json")))
    return errors


def _short(v):
    """Floats to 4 significant digits, through dicts and lists."""
    if isinstance(v, float):
        return float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: _short(x) for k, x in v.items()}
    return [_short(x) for x in v] if isinstance(v, list) else v


def fmt(v, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def render(report: dict) -> str:
    """The docs/benchmarks.md section of one report."""
    p, d = report["parts"], report["device"]
    lines = [f"## GPU check (`tools/gpu_check.py`, {report['date']})", "",
             f"Command: `{report['command']}`. Device: {d['name']} × {d['gpus']}, {d['gib']:.0f} GiB, torch "
             f"{d['torch']}, CUDA {d['cuda']}, Transformer Engine {'yes' if d['te'] else 'no'}; {d['cpus']} CPU "
             f"cores. Total {report['seconds']:.0f} s. Raw figures: `{report['json']}`.", ""]
    for name, part in p.items():
        if part["status"] != "ok":
            lines += [f"- {name}: {part['status']}: {part.get('reason')}"]
    tr = p.get("train", {}).get("results")
    if tr:
        lines += ["", "| run | micro-batch × seq | tokens/s | est. | ratio | MFU | est. MFU | peak alloc GiB | est. GiB |"
                  " ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in tr["runs"]:
            if "tokens_per_s" not in r:
                lines.append(f"| {r['run']} | {r.get('skipped') or 'exit ' + str(r.get('exit'))} |||||||||")
                continue
            lines.append(f"| {r['run']} | {r['micro_batch']} × {r['seq_len']} | {fmt(r['tokens_per_s'])} | "
                         f"{fmt(r['est_tokens_per_s'])} | {fmt(r['tokens_vs_est'], '.2f')} | "
                         f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f')} % | {100 * r['est_mfu']:.0f} % | "
                         f"{fmt(r['peak_alloc_gib'], '.1f')} | {r['est_memory_gib']:.1f} | "
                         f"{fmt(r.get('memory_vs_est'), '.2f')} |")
    ck = p.get("checkpoint", {}).get("results")
    if ck:
        lines += ["", f"Checkpoint: each run's final full save to {ck['target']}.", "",
                  "| run | GiB | training stall s | committed after the last step, s | GiB/s |", "|---|---|---|---|---|"]
        for run, c in ck["saves"].items():
            lines.append(f"| {run} | {fmt(c.get('bytes') and c['bytes'] / 2**30, '.2f')} | {fmt(c.get('stall_s'), '.3f')}"
                         f" | {fmt(c.get('committed_after_s'), '.1f')} | {fmt(c.get('gib_per_s'), '.2f')} |")
    lines.append("")
    for name in ("loader_cuda", "dali", "gds", "nccl"):
        res = p.get(name, {}).get("results")
        if res:
            lines.append(f"- {name}: `{json.dumps(_short(res))}`")
    return "\n".join(lines).rstrip() + "\n"


def write_docs(section: str, path: Path = DOCS) -> None:
    """Replace the text between the markers (appended with them when absent)."""
    text = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{section}{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/gpu_check", help="work folder: configs, runs, checkpoints (local NVMe)")
    ap.add_argument("--budget", type=float, default=470, help="seconds for all parts together")
    ap.add_argument("--parts", default=",".join(n for n, _, _ in PARTS))
    ap.add_argument("--json", default=None, help="results file (default DIR/gpu_check.json)")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite the section in docs/benchmarks.md")
    ap.add_argument("--plan", action="store_true", help="validate the run configs (train launch --dry-run) only")
    ap.add_argument("--gpu-gib", type=float, default=139.0, help="with --plan: GPU memory assumed")
    args = ap.parse_args(argv)
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if args.plan:
        errors = validate_plan(root, args.gpu_gib)
        for e in errors:
            print(f"invalid: {e}", file=sys.stderr)
        return 1 if errors else 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 0
    t0, deadline = time.time(), time.time() + args.budget
    props = torch.cuda.get_device_properties(0)
    ctx = {"dir": root, "device": "cuda", "gpus": torch.cuda.device_count(), "gpu_gib": props.total_memory / 2**30}
    report = {"date": time.strftime("%Y-%m-%d"), "command": "python -m tools.gpu_check " + " ".join(sys.argv[1:]),
              "device": {"name": props.name, "gpus": ctx["gpus"], "gib": ctx["gpu_gib"], "torch": torch.__version__,
                         "cuda": torch.version.cuda, "te": parts.te_installed(), "cpus": os.cpu_count(),
                         "host": platform.node()},
              "json": str(Path(args.json) if args.json else root / "gpu_check.json"), "parts": {}}
    wanted = set(args.parts.split(","))
    for name, fn, seconds in PARTS:
        if name not in wanted:
            continue
        left = deadline - time.time()
        if left < 5:
            res = {"status": "skipped", "reason": "no time left in the overall budget", "seconds": 0}
        else:
            print(f"=== {name} (budget {min(seconds, left):.0f} s)", flush=True)
            res = run_part(fn, ctx, min(seconds, left))
        report["parts"][name], ctx[name] = res, res.get("results") or {}
        print(f"--- {name}: {res['status']} in {res['seconds']} s" + (f": {res['reason']}" if "reason" in res else ""),
              flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    Path(report["json"]).write_text(json.dumps(report, indent=1, default=str))
    section = render(report)
    print(section)
    if not args.no_docs:
        write_docs(section)
        print(f"wrote {report['json']} and the gpu_check section of {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
