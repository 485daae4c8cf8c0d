"""PNG plots per target: throughput vs I/O size (one line per thread count and mode) and IOPS vs threads."""
from __future__ import annotations

import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from storage import atomic
from storage.bench.units import fmt_size

_STYLE = {"buffered": "-", "direct": "--", "s3fs": "-.", "gpu_direct": ":"}


def slug(url: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", url).strip("-")[:80] or "target"


def plot_target(t: dict, out_dir: str) -> list[str]:
    """Write `<slug>-throughput.png` and `<slug>-iops.png`; return their paths."""
    pts = t["results"]
    name = slug(t["target"])
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, test in zip(axes, ("seq_read", "seq_write")):
        groups: dict = {}
        for p in pts:
            if p["test"] == test and p["ops"]:
                groups.setdefault((p["mode"], p["threads"]), []).append((p["io_size"], p["gib_per_s"]))
        for (mode, threads), xy in sorted(groups.items()):
            xy.sort()
            ax.plot([x for x, _ in xy], [y for _, y in xy], _STYLE.get(mode, "-"), marker="o",
                    label=f"{threads} thr ({mode})")
        sizes = sorted({p["io_size"] for p in pts if p["test"] == test})
        ax.set_xscale("log", base=2)
        if sizes:
            ax.set_xticks(sizes, [fmt_size(s) for s in sizes])
        ax.set_title(f"{test.replace('_', ' ')}: {t['target']}", fontsize=9)
        ax.set_xlabel("I/O size")
        ax.set_ylabel("GiB/s")
        ax.grid(alpha=0.3)
        if groups:
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{name}-throughput.png"))
    atomic.save_figure(fig, paths[-1], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    groups = {}
    for p in pts:
        if p["test"] == "rand_read" and p["ops"]:
            groups.setdefault((p["mode"], p["io_size"]), []).append((p["threads"], p["iops"]))
    for (mode, size), xy in sorted(groups.items()):
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], _STYLE.get(mode, "-"), marker="o",
                label=f"{fmt_size(size)} ({mode})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("threads")
    ax.set_ylabel("IOPS (random read)")
    ax.set_title(f"random read: {t['target']}", fontsize=9)
    ax.grid(alpha=0.3)
    if groups:
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{name}-iops.png"))
    atomic.save_figure(fig, paths[-1], dpi=90)
    plt.close(fig)
    return paths
