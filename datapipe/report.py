"""Summaries of a built dataset: the end-of-build table, `datapipe report`, and PNG charts."""
from __future__ import annotations

import json
import os

from storage import atomic, fs
from storage.manifest import Manifest


def summary_lines(m: Manifest, elapsed: dict[str, float] | None = None) -> list[str]:
    """Docs in/out per stage and tokens per source, as fixed-width text lines."""
    cols = ["read", "dropped_read", "dropped_normalize", "filtered", "exact_duplicates", "near_duplicates",
            "decontaminated", "documents", "tokens", "validation_documents"]
    heads = ["read", "bad", "normalize", "filters", "exact dup", "near dup", "decontam", "docs out", "tokens",
             "held out"]
    lines = [f"{'source':<14}" + "".join(f"{h:>12}" for h in heads)]
    tot = dict.fromkeys(cols, 0)
    for name, s in m.sources.items():
        st = dict(s.stats)
        st["filtered"] = sum(v for k, v in st.items() if k.startswith("dropped_") and ":" not in k
                             and k not in ("dropped_read", "dropped_normalize"))
        row = [int(st.get(c, 0)) for c in cols]
        for c, v in zip(cols, row):
            tot[c] += v
        lines.append(f"{name:<14}" + "".join(f"{v:>12,}" for v in row))
    lines.append(f"{'total':<14}" + "".join(f"{tot[c]:>12,}" for c in cols))
    drops = {k: v for k, v in m.build_stats.items() if k.startswith("dropped_") and ":" not in k and v}
    if drops:
        lines.append("dropped per filter: " + ", ".join(f"{k[8:]}={v:,}" for k, v in drops.items()))
    for name, s in m.sources.items():
        if s.kind == "prompts":
            st = s.stats
            rej = {k.split(":", 1)[1]: v for k, v in st.items() if k.startswith("dropped_read:") and v}
            rej["too_long"] = st.get("dropped_too_long", 0)
            lines.append(f"prompts {name}: {st.get('documents', 0):,} training + {st.get('validation_documents', 0):,} "
                         f"held out, {st.get('with_answer', 0):,} with an answer; rejected: "
                         + ", ".join(f"{k}={v:,}" for k, v in rej.items()))
    lines += language_lines(m)
    lines += kind_lines(m)
    lines += quality_lines(m)
    by_task = m.build_stats.get("decontaminated_by_task") or {}
    if by_task:
        lines.append("decontaminated per task: " + ", ".join(f"{k}={v:,}" for k, v in by_task.items()))
    for ph in m.mix:
        w = ", ".join(f"{k}={v:g}" for k, v in ph.weights.items())
        lines.append(f"mix phase {ph.name}: {ph.tokens:,} tokens; weights {w}")
    if elapsed:
        lines.append("elapsed: " + ", ".join(f"{k} {v:.1f}s" for k, v in elapsed.items())
                     + f"; total {sum(elapsed.values()):.1f}s")
    return lines


def language_lines(m: Manifest) -> list[str]:
    """Per source: documents per identified language, read → kept by the filters (share kept)."""
    out = []
    for name, s in m.sources.items():
        read = {k[len("language:"):]: v for k, v in s.stats.items() if k.startswith("language:")}
        if not read:
            continue
        kept = {k[len("kept_language:"):]: v for k, v in s.stats.items() if k.startswith("kept_language:")}
        parts = [f"{lang} {n:,} → {kept.get(lang, 0):,} ({kept.get(lang, 0) / n:.0%})"
                 for lang, n in sorted(read.items(), key=lambda kv: (-kv[1], kv[0]))[:12]]
        more = len(read) - 12
        out.append(f"languages of {name} (read → kept by the filters): " + ", ".join(parts)
                   + (f", {more} more" if more > 0 else ""))
    return out


def _by_prefix(stats: dict, prefix: str) -> dict[str, int]:
    return {k[len(prefix):]: v for k, v in stats.items() if k.startswith(prefix)}


def _read_kept(stats: dict, what: str, top: int = 12) -> str:
    read, kept = _by_prefix(stats, f"{what}:"), _by_prefix(stats, f"kept_{what}:")
    parts = [f"{k} {n:,} → {kept.get(k, 0):,} ({kept.get(k, 0) / n:.0%})"
             for k, n in sorted(read.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]
    return ", ".join(parts) + (f", {len(read) - top} more" if len(read) > top else "")


def kind_lines(m: Manifest) -> list[str]:
    """Per code or math source: why its filters dropped documents, programming languages and licences read
    → kept, redactions, formulas and the math density of what was kept; per kind: redactions in total."""
    out, redacted_by_kind = [], {}
    for name, s in m.sources.items():
        st = s.stats
        if s.content == "web" and not st.get("redacted_documents"):
            continue
        reasons = {k.split(":", 1)[1]: v for k, v in st.items() if k.startswith("dropped_") and ":" in k
                   and not k.startswith("dropped_read:") and v}
        if reasons and s.content != "web":
            out.append(f"{s.content} source {name}: dropped by " + ", ".join(
                f"{k} {v:,}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])))
        if _by_prefix(st, "code_language:"):
            out.append(f"programming languages of {name} (read → kept by the filters): "
                       + _read_kept(st, "code_language"))
        if _by_prefix(st, "license:"):
            out.append(f"licences of {name} (read → kept by the filters): " + _read_kept(st, "license", 8))
        red = _by_prefix(st, "redacted:")
        if red:
            out.append(f"redacted in {name} ({st.get('redacted_documents', 0):,} documents): "
                       + ", ".join(f"{k} {v:,}" for k, v in sorted(red.items(), key=lambda kv: -kv[1])))
            for k, v in red.items():
                redacted_by_kind.setdefault(s.content, {}).setdefault(k, 0)
                redacted_by_kind[s.content][k] += v
        if s.content == "math":
            hist = _by_prefix(st, "kept_math_density:")
            out.append(f"math source {name}: {st.get('formulas', 0):,} formulas; math density of the kept documents "
                       "(tenths): " + ", ".join(f"{k} {v:,}" for k, v in sorted(hist.items())))
    for kind, red in sorted(redacted_by_kind.items()):
        out.append(f"redacted in {kind} sources: " + ", ".join(f"{k} {v:,}" for k, v in sorted(red.items())))
    return out


def quality_lines(m: Manifest) -> list[str]:
    """Per classifier filter of a source, per model: threshold, documents scored and kept, unscored."""
    out = []
    for name, s in m.sources.items():
        for label, q in s.quality.items():
            for key, hist in q["histograms"].items():
                scored, kept = sum(hist), q["kept"].get(key, 0)
                how = f"keep_top {q['keep_top']:g}, calibrated" if q.get("keep_top") is not None else "threshold"
                model = q["models"][key] + ("" if key == "default" else f" ({key})")
                out.append(f"classifier {label} of {name}: model {model}, {how} {q['thresholds'][key]:.4g}; "
                           f"{kept:,} of {scored:,} scored documents kept ({kept / max(scored, 1):.0%})")
            if q.get("unscored"):
                out.append(f"classifier {label} of {name}: {q['unscored']:,} documents of languages without a "
                           "model kept unscored")
    return out


def quality_chart(plt, name: str, quality: dict):
    """One source's score histograms (one panel per classifier filter and model), the threshold marked."""
    panels = [(label, key, q) for label, q in quality.items() for key in q["histograms"]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3 * len(panels)), squeeze=False)
    for ax, (label, key, q) in zip(axes[:, 0], panels):
        lo, hi = q["ranges"][key]
        width = (hi - lo) / q["bins"]
        ax.bar([lo + i * width for i in range(q["bins"])], q["histograms"][key], width=width, align="edge",
               color="tab:blue", edgecolor="white")
        ax.axvline(q["thresholds"][key], color="tab:red", label=f"threshold {q['thresholds'][key]:.4g}")
        ax.set_xlabel("quality score")
        ax.set_ylabel("documents")
        ax.set_title(f"{name}: {label}" + ("" if key == "default" else f" ({key})"))
        ax.legend()
    return fig


def read_elapsed(dataset: str) -> dict[str, float] | None:
    url = fs.join(dataset, "build_report.json")
    if not fs.exists(url):
        return None
    return json.loads(fs.read_bytes(url)).get("elapsed_s")


def charts(m: Manifest, out_dir: str) -> list[str]:
    """drops_per_filter.png and tokens_per_source.png, code_languages.png and math_density.png when there are
    code or math sources, quality_SOURCE.png per source with a classifier filter; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        atomic.save_figure(fig, paths[-1], dpi=100)
        plt.close(fig)

    drops = {k[len("dropped_"):]: v for k, v in m.build_stats.items() if k.startswith("dropped_") and ":" not in k}
    drops["exact dup"] = m.build_stats.get("exact_duplicates", 0)
    drops["near dup"] = m.build_stats.get("near_duplicates", 0)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(list(drops), list(drops.values()), color="tab:red")
    ax.set_xlabel("documents dropped")
    ax.set_title("Documents dropped per filter")
    save(fig, "drops_per_filter.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(m.sources), [s.tokens for s in m.sources.values()], color="tab:blue")
    ax.set_ylabel("tokens")
    ax.set_title("Tokens per source")
    save(fig, "tokens_per_source.png")
    langs: dict[str, list[int]] = {}
    for s in m.sources.values():
        for k, v in _by_prefix(s.stats, "code_language:").items():
            langs.setdefault(k, [0, 0])[0] += v
        for k, v in _by_prefix(s.stats, "kept_code_language:").items():
            langs.setdefault(k, [0, 0])[1] += v
    if langs:
        top = sorted(langs.items(), key=lambda kv: -kv[1][0])[:20]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh([k for k, _ in top], [v[0] for _, v in top], color="tab:gray", label="read")
        ax.barh([k for k, _ in top], [v[1] for _, v in top], color="tab:green", label="kept by the filters")
        ax.invert_yaxis()
        ax.set_xlabel("files")
        ax.set_title("Code files per programming language")
        ax.legend()
        save(fig, "code_languages.png")
    hist: dict[str, int] = {}
    for s in m.sources.values():
        for k, v in _by_prefix(s.stats, "kept_math_density:").items():
            hist[k] = hist.get(k, 0) + v
    if hist:
        fig, ax = plt.subplots(figsize=(6, 4))
        bins = [f"{b / 10:.1f}" for b in range(10)]
        ax.bar(bins, [hist.get(b, 0) for b in bins], color="tab:purple")
        ax.set_xlabel("math density (share of math characters), lower edge")
        ax.set_ylabel("documents kept")
        ax.set_title("Math density of math sources")
        save(fig, "math_density.png")
    for name, s in m.sources.items():
        if s.quality:
            save(quality_chart(plt, name, s.quality), f"quality_{name}.png")
    return paths
