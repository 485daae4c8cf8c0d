"""The statistics and report of `train ablate` (train.ablate): per variant and metric the mean and standard
error over seeds, a verdict against the baseline, the table (printed, OUTPUT/report.md, OUTPUT/report.json)
and one PNG per metric (OUTPUT/plots/).

Standard error of a variant's mean: the sample standard deviation over its seeds / sqrt(K). A variant is
compared with the baseline by z = (difference of means) / sqrt(se_variant² + se_baseline²), signed so that
z > 0 means the variant is better (lower for losses, bits per byte and perplexity; higher otherwise):
"better by 4.1 standard errors" or "worse by 2.0 standard errors" when |z| >= 1, else "no difference
within 1 standard error". Fewer than two seeds on either side give no standard error and no verdict.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from storage import atomic
from storage.config import ConfigError

LOWER_IS_BETTER = ("loss", "bpb", "ppl", "perplexity", "bits_per_byte")
NOT_METRICS = ("tokens", "eval_time_s", "size_bytes")


def lower_is_better(key: str) -> bool:
    """Losses, bits per byte and perplexities: lower is better; accuracies, exact match, pass@k: higher."""
    return key.rsplit("/", 1)[-1] in LOWER_IS_BETTER


def default_metrics(keys: set[str]) -> list[str]:
    """Every validation loss and bits per byte, then every task metric (execution counts left out)."""
    val = sorted(k for k in keys if k.startswith("val/") and k.rsplit("/", 1)[-1] in ("loss", "bpb"))
    tasks = sorted(k for k in keys if k.startswith("eval/") and "/executions/" not in k
                   and k.rsplit("/", 1)[-1] not in NOT_METRICS)
    return val + tasks


@dataclass
class Stats:
    values: dict[int, float]  # seed → value
    n: int = 0
    mean: float = math.nan
    se: float = math.nan  # nan with fewer than two seeds

    def __post_init__(self) -> None:
        xs = list(self.values.values())
        self.n = len(xs)
        if xs:
            self.mean = sum(xs) / len(xs)
        if len(xs) > 1:
            var = sum((x - self.mean) ** 2 for x in xs) / (len(xs) - 1)
            self.se = math.sqrt(var / len(xs))


def compare(var: Stats, base: Stats, lower_better: bool) -> tuple[float | None, str]:
    """(z, verdict): z > 0 when `var` is better than `base` (None without standard errors)."""
    if var.n < 2 or base.n < 2:
        return None, "no verdict: a standard error needs at least 2 seeds on each side"
    diff = (base.mean - var.mean) if lower_better else (var.mean - base.mean)
    se = math.sqrt(var.se ** 2 + base.se ** 2)
    if se == 0:
        z = 0.0 if diff == 0 else math.copysign(math.inf, diff)
    else:
        z = diff / se
    if abs(z) < 1:
        return z, "no difference within 1 standard error"
    if math.isinf(z):
        return z, f"{'better' if z > 0 else 'worse'} on every seed alike (no spread: no standard error)"
    return z, f"{'better' if z > 0 else 'worse'} by {abs(z):.1f} standard errors"


@dataclass
class Row:
    metric: str
    variant: str
    stats: Stats
    z: float | None = None
    verdict: str = ""  # empty for the baseline


@dataclass
class Report:
    baseline: str
    variants: list[str]
    metrics: list[str]
    rows: list[Row] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # labels of runs without results

    def verdict_lines(self) -> list[str]:
        out = []
        for r in self.rows:
            if r.verdict:
                b = next(x for x in self.rows if x.metric == r.metric and x.variant == self.baseline)
                out.append(f"{r.variant} vs {self.baseline} on {r.metric}: {r.verdict} "
                           f"({_pm(r.stats)} vs {_pm(b.stats)}, {r.stats.n} and {b.stats.n} seeds)")
        return out

    def markdown(self, header: list[str]) -> str:
        lines = [*header, "", "| metric | variant | seeds | mean | SE | vs baseline | verdict |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.rows:
            b = next(x for x in self.rows if x.metric == r.metric and x.variant == self.baseline)
            delta = "" if r.variant == self.baseline else f"{r.stats.mean - b.stats.mean:+.4g}"
            name = f"{r.variant} (baseline)" if r.variant == self.baseline else r.variant
            arrow = "lower is better" if lower_is_better(r.metric) else "higher is better"
            metric = f"`{r.metric}` ({arrow})" if r.variant == self.variants[0] else ""
            lines.append(f"| {metric} | {name} | {r.stats.n} | {_num(r.stats.mean)} | {_num(r.stats.se)} | {delta} "
                         f"| {r.verdict} |")
        if self.missing:
            lines += ["", f"Runs without results (left out): {', '.join(self.missing)}."]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        out: dict = {"baseline": self.baseline, "variants": self.variants, "missing": self.missing, "metrics": {}}
        for r in self.rows:
            m = out["metrics"].setdefault(r.metric, {"lower_is_better": lower_is_better(r.metric), "variants": {}})
            m["variants"][r.variant] = {
                "n": r.stats.n, "mean": _finite(r.stats.mean), "se": _finite(r.stats.se),
                "values": {str(s): v for s, v in r.stats.values.items()},
                **({} if r.variant == self.baseline else {"z": _finite(r.z), "verdict": r.verdict})}
        return out


def _finite(x: float | None) -> float | str | None:
    return x if x is None or math.isfinite(x) else str(x)


def _num(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.4g}"


def _pm(s: Stats) -> str:
    return f"{_num(s.mean)} ± {_num(s.se)}"


def build_report(results: list[dict], variants: list[str], baseline: str, metrics: list[str],
                 expected: list[str]) -> Report:
    """`results`: one record per finished run ({variant, seed, metrics}); `metrics`: the config's choice
    ([]: default_metrics); `expected`: every run's label, for the list of missing ones."""
    keys = {k for r in results for k in r["metrics"]}
    for i, m in enumerate(metrics):
        if results and m not in keys:
            raise ConfigError(f"key 'metrics.{i}': no result has {m!r} (results have: "
                              f"{', '.join(default_metrics(keys)) or 'nothing'})")
    chosen = list(metrics) or default_metrics(keys)
    done = {f"{r['variant']}.s{r['seed']}" for r in results}
    rep = Report(baseline, [baseline] + [v for v in variants if v != baseline], chosen,
                 missing=[lab for lab in expected if lab not in done])
    for m in chosen:
        per = {v: Stats({r["seed"]: r["metrics"][m] for r in results if r["variant"] == v and m in r["metrics"]})
               for v in rep.variants}
        for v in rep.variants:
            row = Row(m, v, per[v])
            if v != baseline:
                row.z, row.verdict = compare(per[v], per[baseline], lower_is_better(m))
            rep.rows.append(row)
    return rep


def plot_metric(rep: Report, metric: str, results: list[dict], out: Path) -> Path:
    """One PNG: mean ± SE per variant (bars), each seed's value as a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 * len(rep.variants) + 2.5, 4))
    for i, v in enumerate(rep.variants):
        s = next(r.stats for r in rep.rows if r.metric == metric and r.variant == v)
        seeds = sorted(s.values)
        xs = [i + 0.12 * (j - (len(seeds) - 1) / 2) / max(1, len(seeds) - 1) for j in range(len(seeds))]
        ax.scatter(xs, [s.values[k] for k in seeds], s=14, color="0.5", zorder=2,
                   label="one seed" if i == 0 else None)
        if s.n:
            ax.errorbar([i], [s.mean], yerr=[0 if math.isnan(s.se) else s.se], fmt="o", capsize=6, ms=7,
                        color="C3" if v == rep.baseline else "C0", zorder=3,
                        label="mean ± SE" if i == 0 else None)
    ax.set_xticks(range(len(rep.variants)), [f"{v}\n(baseline)" if v == rep.baseline else v for v in rep.variants])
    ax.set_title(f"{metric} ({'lower' if lower_is_better(metric) else 'higher'} is better)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic.save_figure(fig, str(out), dpi=100)
    plt.close(fig)
    return out


def write_report(rep: Report, results: list[dict], out_dir: Path, header: list[str]) -> list[Path]:
    """OUTPUT/report.md, OUTPUT/report.json and OUTPUT/plots/<metric>.png; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    atomic.write_bytes(str(md), (rep.markdown(header) + "\n" + "\n".join(
        f"- {line}" for line in rep.verdict_lines()) + "\n").encode())
    js = out_dir / "report.json"
    atomic.write_bytes(str(js), json.dumps({"header": header, **rep.to_json()}, indent=1).encode())
    plots = out_dir / "plots"
    plots.mkdir(exist_ok=True)
    paths = [md, js]
    for m in rep.metrics if results else []:
        paths.append(plot_metric(rep, m, results, plots / (re.sub(r"[^A-Za-z0-9_.+-]+", "_", m) + ".png")))
    return paths
