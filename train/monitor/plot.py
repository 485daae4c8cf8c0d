"""`train plot RUN_DIR`: PNG curves (loss, grad norm, LR, tokens/s, MFU, memory) from metrics.jsonl, and,
when the run evaluated in the loop, `eval.png`: validation loss and bits per byte per source and each
task's acc_norm against tokens seen."""
from __future__ import annotations

import json
from pathlib import Path

from storage import atomic

PANELS = [("loss", "loss"), ("grad_norm", "grad norm"), ("lr", "learning rate"),
          ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("mem_gib", "memory (GiB)")]


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory?)")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if "loss" in r]


def read_evals(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            if r.get("kind") == "eval"]


def plot_evals(run_dir: str | Path, out: Path) -> Path | None:
    """eval.png next to the training plot: one panel per quantity, one line per source or task."""
    import matplotlib.pyplot as plt

    recs = read_evals(run_dir)
    if not recs:
        return None
    keys = sorted({k for r in recs for k in r if k.startswith(("val/", "eval/"))})
    panels = [("validation loss", [k for k in keys if k.startswith("val/") and k.endswith("/loss")]),
              ("validation bits per byte", [k for k in keys if k.startswith("val/") and k.endswith("/bpb")]),
              ("benchmarks (acc_norm)", [k for k in keys if k.startswith("eval/") and k.endswith("/acc_norm")])]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, ks) in zip(axes[0], panels):
        for k in ks:
            pts = [(r["consumed_tokens"], r[k]) for r in recs if r.get(k) is not None]
            ax.plot(*zip(*pts), marker="o", lw=1.2, label=k.split("/")[1])
        ax.set_title(title)
        ax.set_xlabel("tokens seen")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{run_dir}: evaluation")
    fig.tight_layout()
    atomic.save_figure(fig, str(out), dpi=100)
    plt.close(fig)
    return out


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    if not recs:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step records")
    for r in recs:
        r["mem_gib"] = r.get("reserved_gib", r.get("rss_gib"))
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    steps = [r["step"] for r in recs]
    for ax, (key, title) in zip(axes.flat, PANELS):
        ys = [r.get(key) for r in recs]
        pts = [(s, y) for s, y in zip(steps, ys) if y is not None]
        if pts:
            ax.plot(*zip(*pts), lw=1.2)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    atomic.save_figure(fig, str(out), dpi=100)
    plt.close(fig)
    plot_evals(run_dir, out.with_name("eval.png"))
    return out
