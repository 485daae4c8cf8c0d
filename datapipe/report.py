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


def read_elapsed(dataset: str) -> dict[str, float] | None:
    url = fs.join(dataset, "build_report.json")
    if not fs.exists(url):
        return None
    return json.loads(fs.read_bytes(url)).get("elapsed_s")


def charts(m: Manifest, out_dir: str) -> list[str]:
    """drops_per_filter.png and tokens_per_source.png; returns their paths."""
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
    return paths
