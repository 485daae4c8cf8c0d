"""The evaluation table (`train eval --table`, and a model card's): one row per evaluated checkpoint, one
column per task, from `train eval` result records (train.eval.results reads them)."""
from __future__ import annotations


# generative tasks' columns in the table: lm-eval's metric[,filter] → a short header
GENERATIVE_COLUMNS = {"exact_match,strict-match": "strict", "exact_match,flexible-extract": "flex",
                      "prompt_level_strict_acc": "prompt-strict", "inst_level_loose_acc": "inst-loose",
                      "pass@1": "pass@1", "pass@10": "pass@10", "math_verify": "math_verify"}


# what serving a model costs (train.eval.speed): metric → (header, divisor, digits)
COST_COLUMNS = {"size_bytes": ("size MiB", 2**20, 2), "generation_tokens_per_s": ("gen tok/s", 1, 1)}


def format_table(recs: list[dict], metric: str = "acc_norm") -> str:
    """The table of these result records (train.eval.results.table documents its columns)."""
    labeled = any(r.get("label") for r in recs)
    every = {t: d for r in recs for t, d in r.get("tasks", {}).items()}
    bpb = sorted(t for t, d in every.items() if not d.get("generative") and "bpb" in d.get("metrics", {}))
    tasks = sorted(t for t, d in every.items() if not d.get("generative") and t not in bpb)
    gen = [(t, k) for t in sorted(t for t, d in every.items() if d.get("generative"))
           for k in GENERATIVE_COLUMNS if any(k in r.get("tasks", {}).get(t, {}).get("metrics", {}) for r in recs)]
    cost = [k for k in COST_COLUMNS if any(k in r["metrics"] for r in recs)]
    head = (["label" if labeled else "checkpoint", "step", "tokens", "val loss", "val bpb"] + [f"{t} bpb" for t in bpb]
            + tasks + ([f"mean {metric}"] if tasks else []) + [f"{t} {GENERATIVE_COLUMNS[k]}" for t, k in gen]
            + [COST_COLUMNS[k][0] for k in cost])
    rows = []
    for r in recs:
        m = r["metrics"]
        vals = [r["tasks"][t]["metrics"].get(metric) if t in r.get("tasks", {}) else None for t in tasks]
        known = [v for v in vals if v is not None]
        row = [r.get("label") or r["checkpoint"], str(r["step"]) if "hf_folder" not in r else "hf", f"{r.get('consumed_tokens', 0):,}",
               _f(m.get("val/all/loss"), 4), _f(m.get("val/all/bpb"), 3)]
        row += [_f(r.get("tasks", {}).get(t, {}).get("metrics", {}).get("bpb"), 3) for t in bpb]
        row += [_f(v, 3) for v in vals]
        if tasks:
            row.append(_f(sum(known) / len(known), 3) if known else "-")
        row += [_f(r.get("tasks", {}).get(t, {}).get("metrics", {}).get(k), 3) for t, k in gen]
        row += [_f(m[k] / COST_COLUMNS[k][1] if k in m else None, COST_COLUMNS[k][2]) for k in cost]
        rows.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    note = f"({metric}; chance level is 1 / number of choices: 0.25 for 4, 0.5 for 2"
    note += "; generative: exact match / instruction accuracy)" if gen else ")"
    return "\n".join(lines) + "\n" + note


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
