"""Sources left with no documents: one line each, naming the source, its input count and the count each
filter (and dedup) dropped; a mix that gives weight to such a source is refused at build time.

The build checks twice in the driver: after the scan stage (what the filters left, before any dedup
work) and before the manifest (what dedup and decontamination left). The policy for an empty source:
- the mix names it in a phase (`mix.phases.N.weights`), or every source is empty: the build stops with
  those lines (exit status 1), since the dataset could not be trained on as configured;
- otherwise the build goes on and writes the other sources; the line is printed as a warning, the
  manifest keeps the source with 0 documents and its counts, and the default mix (no phases) leaves it out.
"""
from __future__ import annotations

from datapipe.config import BuildConfig


class EmptyResultError(RuntimeError):
    """A source or mix phase with no documents that the build cannot go on without."""


def describe(name: str, stats: dict[str, int], stage: str) -> str:
    """`source 'web': no documents left after the filters (120 read; dropped: ...)`."""
    drops = [(k[len("dropped_"):], v) for k, v in stats.items() if k.startswith("dropped_") and ":" not in k]
    drops += [(k, stats[k]) for k in ("exact_duplicates", "near_duplicates", "decontaminated") if k in stats]
    reasons = sorted(((k[len("dropped_"):], v) for k, v in stats.items()
                      if k.startswith("dropped_") and ":" in k and v), key=lambda kv: -kv[1])[:3]
    langs = sorted(((k[len("language:"):], v) for k, v in stats.items() if k.startswith("language:")),
                   key=lambda kv: -kv[1])[:5]
    line = (f"source {name!r}: no documents left after {stage} ({stats.get('read', 0):,} read; dropped: "
            + ", ".join(f"{k} {v:,}" for k, v in drops) + ")")
    if reasons:
        line += "; top reasons: " + ", ".join(f"{k} {v:,}" for k, v in reasons)
    if langs:
        line += "; languages read: " + ", ".join(f"{k} {v:,}" for k, v in langs)
    return line


def check(cfg: BuildConfig, left: dict[str, int], stats: dict[str, dict[str, int]], stage: str) -> list[str]:
    """Lines for the sources with `left[name] == 0`. Raises EmptyResultError (all its lines in the
    message, one per source) if the build cannot go on; else returns them as warnings."""
    empty = [s.name for s in cfg.sources if left.get(s.name, 0) == 0]
    if not empty:
        return []
    lines = {n: describe(n, stats.get(n, {}), stage) for n in empty}
    weighted = []
    for i, ph in enumerate(cfg.mix.phases):
        for n in empty:
            if ph.weights.get(n, 0) > 0:
                weighted.append(f"{lines.pop(n, describe(n, stats.get(n, {}), stage))}; the mix gives it weight "
                                f"{ph.weights[n]:g} in phase {ph.name!r} (key 'mix.phases.{i}.weights.{n}')")
    if weighted:
        raise EmptyResultError("\n".join(weighted))
    if len(empty) == len(cfg.sources):
        raise EmptyResultError("\n".join(lines[n] for n in empty))
    return [f"{line}; the build goes on without it" for line in lines.values()]
