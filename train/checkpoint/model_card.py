"""The model card (README.md) that `train ckpt export` writes into a Hugging Face folder.

The Hub's YAML metadata, written through huggingface_hub's ModelCardData (so `ModelCard.load` reads it and
its metadata validates): library_name, pipeline_tag, license, base_model (when the first stage started from
a `train ckpt import` of a Hub model), datasets and languages (from the manifests of the datasets the
stages trained on), tags, and the checkpoint's `train eval` results in model-index form. The body holds the
same evaluation table that `train eval --table` prints for the checkpoint and the training recipe: every
stage of meta.stages (objective, start, steps, tokens, sequence length, learning rate, dataset, mix).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import fsspec

from train.checkpoint import layout

HUB_CACHE = re.compile(r"models--([^/]+)--([^/]+)")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _manifest(path: str) -> dict:
    try:
        return layout.read_manifest(fsspec.filesystem("file"), path)
    except Exception:  # noqa: BLE001 - a deleted or unreadable earlier checkpoint: its part is unknown
        return {}


def base_model(ckpt_dir: str, stages: list[dict]) -> str | None:
    """The Hub id of the model the first stage started from, when that was a `train ckpt import` of a Hub
    download (a cache path models--ORG--NAME, or a folder whose config names ORG/NAME)."""
    first = ckpt_dir if not stages or len(stages) < 2 else stages[1].get("init")
    meta = (_manifest(first).get("meta") or {}) if first else {}
    source = (meta.get("hf") or {}).get("source")
    if not source:
        return None
    m = HUB_CACHE.search(source)
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    try:
        name = json.loads(Path(source, "config.json").read_text()).get("_name_or_path", "")
    except (OSError, ValueError):
        return None
    return name if HUB_ID.fullmatch(name or "") and not os.path.exists(name) else None


def dataset_facts(stages: list[dict]) -> tuple[list[str], list[str], list[dict]]:
    """(dataset names, ISO languages seen in them, one row per stage dataset) from the stages' manifests."""
    from storage.manifest import read_manifest

    names, langs, rows = [], set(), []
    for s in stages:
        ds = s.get("dataset")
        if not ds or ds == "synthetic" or any(r["dataset"] == ds for r in rows):
            continue
        try:
            man = read_manifest(ds)
        except Exception:  # noqa: BLE001 - moved or deleted since training: named, not described
            rows.append({"dataset": ds, "sources": "(manifest not readable)"})
            continue
        name = os.path.basename(ds.rstrip("/"))
        if name not in names:
            names.append(name)
        langs |= set(man.languages())  # as the dataset's own card lists them
        rows.append({"dataset": ds, "sources": ", ".join(f"{n} ({src.tokens:,} tokens, {src.content})"
                                                          for n, src in sorted(man.sources.items()))})
    return names, sorted(langs), rows


def eval_results(rec: dict | None, model_name: str) -> list:
    """huggingface_hub EvalResults (model-index) of one `train eval` record: every task's scores and the
    validation loss and bits per byte."""
    from huggingface_hub import EvalResult

    if not rec:
        return []
    out = []
    for task, d in sorted(rec.get("tasks", {}).items()):
        for metric, v in sorted(d.get("metrics", {}).items()):
            if isinstance(v, (int, float)) and metric not in ("items", "chance") and not metric.endswith("stderr"):
                out.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                      metric_type=metric, metric_value=float(v)))
    for key in ("val/all/loss", "val/all/bpb"):
        if key in rec.get("metrics", {}):
            out.append(EvalResult(task_type="text-generation", dataset_type="validation",
                                  dataset_name="held-out validation split", metric_type=key.rsplit("/", 1)[1],
                                  metric_value=float(rec["metrics"][key])))
    return out


def find_eval(ckpt_dir: str) -> dict | None:
    """The `train eval` record of this checkpoint in its run's eval/ folder, if it was evaluated."""
    p = Path(ckpt_dir).resolve()
    path = p.parent.parent / "eval" / f"{p.name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def tokens_at(run_dir: Path, step: int) -> int | None:
    """The tokens a run had consumed at `step` (its metrics.jsonl; None when not logged there)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a killed run's cut last line
            continue
        if "loss" in r and r.get("step") == step:
            found = r.get("consumed_tokens")
    return found


def stage_tokens(ckpt_dir: str, stages: list[dict], step: int | None) -> list[int | None]:
    """Tokens each stage trained on: where the next stage started (its init checkpoint's step in that run's
    metrics), the last stage up to this checkpoint."""
    if not stages:
        return []
    ends = [(Path(s["init"]).resolve().parent.parent, s.get("init_step")) for s in stages[1:] if s.get("init")]
    ends = ends if len(ends) == len(stages) - 1 else [(None, None)] * (len(stages) - 1)
    ends.append((Path(ckpt_dir).resolve().parent.parent, step))
    return [tokens_at(run, st) if run is not None and st is not None else None for run, st in ends]


def _recipe(stages: list[dict], tokens: list[int | None]) -> list[str]:
    lines = ["| stage | objective | started from | steps | tokens | seq len | lr (min) | schedule | dataset | mix |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s, tok in zip(stages, tokens, strict=True):
        if s.get("recorded") is False:
            lines.append(f"| {s['stage']} | ({s.get('origin')}) | | | | {s.get('seq_len') or ''} | | | | |")
            continue
        lr = f"{s.get('lr')} ({s.get('min_lr')})" if s.get("lr") is not None else ""
        mix = ", ".join(f"{k} {v}" for k, v in (s.get("mix") or {}).items())
        start = f"{os.path.basename(os.path.dirname(os.path.dirname(s['init'])))}/{os.path.basename(s['init'])}" \
            if s.get("init") else "random init"
        lines.append(f"| {s['stage']} | {s.get('objective', '')} | {start} | {s.get('steps', '')} | "
                     f"{'' if tok is None else f'{tok:,}'} | {s.get('seq_len', '')} | {lr} | {s.get('schedule', '')} | "
                     f"{s.get('dataset') or ''} | {mix} |")
    return lines


def build(ckpt_dir: str, license: str | None = None, rec: dict | None = None) -> str:
    """README.md's text for the export of `ckpt_dir`; `rec`: its `train eval` record (default: the run's
    eval/<checkpoint>.json when present)."""
    from huggingface_hub import ModelCard, ModelCardData

    from train.monitor.eval_table import format_table

    m = _manifest(ckpt_dir)
    meta = m.get("meta") or {}
    stages = list(meta.get("stages") or [])
    rec = rec if rec is not None else find_eval(ckpt_dir)
    run = Path(ckpt_dir).resolve().parent.parent.name
    name = f"{run}-{m.get('name', os.path.basename(ckpt_dir))}"
    datasets, languages, ds_rows = dataset_facts(stages)
    objectives = sorted({s["objective"] for s in stages if s.get("objective")})
    base = base_model(ckpt_dir, stages)
    data = ModelCardData(
        model_name=name, library_name="transformers", pipeline_tag="text-generation", license=license or "other",
        base_model=base, datasets=datasets or None, language=languages or None,
        tags=["smoltrain", "megatron-core", "llama", *objectives], eval_results=eval_results(rec, name) or None)
    mod = meta.get("model") or {}
    body = [f"# {name}", "",
            f"A {mod.get('num_layers')}-layer Llama-architecture model (hidden size {mod.get('hidden_size')}, "
            f"{mod.get('num_heads')} heads, {mod.get('num_kv_heads')} KV heads, vocabulary "
            f"{mod.get('vocab_size')}) trained with smoltrain on megatron-core: checkpoint "
            f"`{m.get('name')}` (step {m.get('step')}) of run `{run}`, exported by `train ckpt export`.", ""]
    if base:
        body += [f"Started from [{base}](https://huggingface.co/{base}).", ""]
    if not license:
        body += ["License: not set at export (`train ckpt export --license ID`); the data's licenses apply.", ""]
    body += ["## Training recipe", "", "Tokens: what each stage trained on (the last one up to this checkpoint), "
             "from its run's metrics.", "", *_recipe(stages, stage_tokens(ckpt_dir, stages, m.get("step"))), ""]
    if ds_rows:
        body += ["## Data", "", "| dataset | sources |", "|---|---|",
                 *[f"| {r['dataset']} | {r['sources']} |" for r in ds_rows], ""]
    body += ["## Evaluation", ""]
    if rec is None:
        body += ["Not evaluated before export (`train eval CHECKPOINT`, then export again).", ""]
    else:
        body += ["`train eval --table` for this checkpoint:", "", "```", format_table([rec]), "```", ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)).content
