"""`train eval` around the worker: which checkpoints and config, torchrun, results as one JSON per
checkpoint in RUN_DIR/eval/ (or --out), and the table (one row per checkpoint, one column per task).

Targets are CHECKPOINT|RUN_DIR or LABEL=CHECKPOINT|RUN_DIR: checkpoints of different runs (the stages of a
chain: pretrain, mid-training, SFT, DPO, merged) are evaluated under one config in one worker; a labeled
one's result is OUT/LABEL.json with "label", and the table shows the labels in the order of evaluation.

A checkpoint's config is its run's `config.yaml` (RUN_DIR/checkpoints/step_N → RUN_DIR/config.yaml),
with `--set` overrides on top (e.g. `parallel.tp=2`: evaluation reshards on load); without a run
config, the model shape, precision and sequence length recorded in the checkpoint manifest are used.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fsspec

from storage import atomic
from storage import config as cfgmod
from storage.config import ConfigError
from train.checkpoint import layout
from train.config import TrainConfig
from train.monitor.eval_table import format_table


def run_dir_of(path: str) -> Path | None:
    """The run directory holding `path` (itself, or a checkpoint two levels below), if it has config.yaml."""
    p = Path(path).resolve()
    for cand in (p, p.parent.parent):
        if (cand / "config.yaml").is_file():
            return cand
    return None


LABEL = re.compile(r"[A-Za-z0-9_.+-]+")


def parse_targets(targets: list[str] | tuple[str, ...], every: bool) -> tuple[list[str], list[str | None]]:
    """`train eval`'s TARGETs → (checkpoint paths, one label or None each). A target is CHECKPOINT|RUN_DIR
    (a run dir: its newest checkpoint, or all of them with `every`) or LABEL=CHECKPOINT|RUN_DIR; a target
    that exists as a path is a path even if it holds '='. `every` takes a single unlabeled RUN_DIR."""
    if every and len(targets) != 1:
        raise ConfigError(f"--all takes a single RUN_DIR ({len(targets)} targets given)")
    ckpts: list[str] = []
    labels: list[str | None] = []
    for t in targets:
        label, path = None, t
        if "=" in t and not os.path.exists(t):
            label, path = t.split("=", 1)
            if not LABEL.fullmatch(label):
                raise ConfigError(f"{t}: bad label {label!r} (LABEL=CHECKPOINT, a LABEL of letters, digits "
                                  "and _ . + -)")
            if not path:
                raise ConfigError(f"{t}: no checkpoint after '{label}='")
            if every:
                raise ConfigError(f"{t}: --all does not take a label (each checkpoint is named by its step)")
        found = layout.find_checkpoints(path, every)
        ckpts += found
        labels += [label] * len(found)
    names = [lab or os.path.basename(c) for c, lab in zip(ckpts, labels)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"two targets would both write {dup[0]}.json: give each its own LABEL=")
    return ckpts, labels


def checkpoint_model(ckpt: str) -> dict:
    """The model config a checkpoint's manifest records (meta.model; {} when it records none)."""
    from train.model.gpt import ModelConfig

    model = (layout.read_manifest(fsspec.filesystem("file"), ckpt).get("meta") or {}).get("model") or {}
    return {k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}


def resolve_config(ckpt: str, config_path: str | None, overrides: list[str]) -> TrainConfig:
    """The config to evaluate `ckpt` with: CONFIG (or its run's config.yaml) with the model shape the
    checkpoint records (a pruned or distilled checkpoint is evaluated under its own shape), else a config
    made from its manifest alone."""
    run_dir = run_dir_of(ckpt)
    path = config_path or (str(run_dir / "config.yaml") if run_dir else None)
    if path:
        shape = [f"model.{k}={json.dumps(v)}" for k, v in checkpoint_model(ckpt).items()]
        return cfgmod.load(TrainConfig, path, shape + list(overrides))
    meta = layout.read_manifest(fsspec.filesystem("file"), ckpt).get("meta") or {}
    if "model" not in meta:
        raise ConfigError(f"{ckpt}: no run config.yaml beside it and no model recorded in its manifest; "
                          "give --config")
    sets = [f"model.{k}={json.dumps(v)}" for k, v in meta["model"].items()]
    sets += [f"precision={meta.get('precision', 'fp32')}", f"data.seq_len={meta.get('seq_len', 256)}",
             "debug.synthetic_data=true"]
    if meta.get("tokenizer"):
        ds = os.path.dirname(meta["tokenizer"])
        if os.path.isfile(os.path.join(ds, "manifest.json")):
            sets += [f"data.dataset={ds}", "debug.synthetic_data=false"]
    return cfgmod.load(TrainConfig, None, sets + list(overrides))


def checkpoint_tokenizer(cfg: TrainConfig, ckpt: str) -> str | None:
    """The tokenizer the benchmarks are encoded with: the dataset's, else the one the checkpoint recorded,
    else the one an imported checkpoint carries (its HF tokenizer files)."""
    if cfg.data.dataset and not cfg.debug.synthetic_data:
        from storage import fs
        from storage.manifest import read_manifest

        return fs.join(cfg.data.dataset, read_manifest(cfg.data.dataset).tokenizer.file)
    from train.checkpoint.export_hf import carried_dir

    m = layout.read_manifest(fsspec.filesystem("file"), ckpt)
    carried = carried_dir(ckpt, m)
    if carried and os.path.isfile(os.path.join(carried, "tokenizer.json")):
        return (m.get("meta") or {}).get("tokenizer") or os.path.join(carried, "tokenizer.json")
    return (m.get("meta") or {}).get("tokenizer")


def launch(ckpts: list[str], cfg: TrainConfig, out_dir: str, nproc: int, tokenizer: str | None = None,
           labels: list[str | None] | None = None) -> int:
    """Validate, then run the worker under torchrun (standalone, nproc processes). `labels`: one per
    checkpoint (None: named by the checkpoint), written as OUT/LABEL.json."""
    if labels is not None and len(labels) != len(ckpts):
        raise ValueError(f"{len(labels)} labels for {len(ckpts)} checkpoints")
    cfg.check_world(nproc)
    cfg.validate()
    tok = tokenizer or checkpoint_tokenizer(cfg, ckpts[0])
    if cfg.eval.tasks and not tok:
        raise ConfigError("key 'eval.tasks': no tokenizer known for this checkpoint; give --tokenizer")
    cfg.eval.check_tasks()
    os.makedirs(out_dir, exist_ok=True)
    atomic.sweep(out_dir)  # result files an interrupted evaluation left half-written
    # the workers' spec lives in the system's temporary folder (standalone: one machine), not in OUT
    with tempfile.TemporaryDirectory(prefix="smoltrain-eval-") as tmp:
        cfg_path = os.path.join(tmp, "config.yaml")
        cfgmod.save(cfg, cfg_path)
        spec = os.path.join(tmp, "spec.json")
        with open(spec, "w") as f:
            json.dump({"config": cfg_path, "checkpoints": ckpts, "labels": labels, "out_dir": out_dir,
                       "tokenizer": tok}, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "train.eval.run", spec]
        print("+ " + shlex.join(cmd), flush=True)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        return subprocess.call(cmd, env=env)


def write_result(out_dir: str, rec: dict) -> str:
    """OUT/<label>.json for a labeled record, else OUT/<checkpoint>.json; stamps "evaluated_at"."""
    rec.setdefault("evaluated_at", time.time())
    path = os.path.join(out_dir, f"{rec.get('label') or rec['checkpoint']}.json")
    atomic.write_bytes(path, json.dumps(rec, indent=1).encode())
    return path


def results_folder(path: str) -> Path:
    """DIR/eval of a run dir, or DIR itself when it is a folder of result JSONs (and has no eval/)."""
    p = Path(path)
    if (p / "eval").is_dir() or not any(p.glob("*.json")):
        return p / "eval"
    return p


def read_results(path: str) -> list[dict]:
    """The records of a run dir's eval/ or of a results folder. Labeled ones (a chain of runs) are ordered
    by evaluation time, i.e. in the order the targets were given; otherwise by step."""
    folder = results_folder(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no evaluation results (run `train eval {path} --all` first)")
    recs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if not p.name.startswith(".")]
    recs = [r for r in recs if isinstance(r, dict) and "checkpoint" in r and "metrics" in r]
    if not recs:
        raise FileNotFoundError(f"{folder}: no `train eval` result files")
    if any(r.get("label") for r in recs):
        return sorted(recs, key=lambda r: (r.get("evaluated_at", 0.0), r["step"]))
    return sorted(recs, key=lambda r: r["step"])


def table(path: str, metric: str = "acc_norm") -> str:
    """One row per checkpoint: its label (if any record has one) or name, step, tokens, validation loss and
    bpb, the bits per byte of every gold-answer task (`codex_humaneval:gold_bpb_0shot`), then `metric` for
    every log-likelihood task and their mean, then the generative tasks' headline metrics (GSM8K exact
    match, strict and flexible; IFEval prompt-level strict, instruction-level loose; HumanEval and MBPP
    pass@1, pass@10 with 10+ samples; MATH-500 math_verify), then
    the weights' size on disk and the generation speed when measured (`train eval --hf` records both)."""
    return format_table(read_results(path), metric)
