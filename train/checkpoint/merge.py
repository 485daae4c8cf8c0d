"""Merge checkpoints by weighted averaging of their weights (`train ckpt merge`).

    train ckpt merge --linear A:0.9 B:0.1 OUT     weights given per input (CHECKPOINT:WEIGHT)
    train ckpt merge --soup CK1 CK2 CK3 OUT       uniform average ("model soup")

Each input is a step folder, or a run directory / checkpoints folder meaning its newest checkpoint that
verifies (`init_from.find_checkpoint`: every input is checksummed first). Inputs may come from any TP/PP
layout and be full or incremental: their whole tensors are read in Hugging Face Llama names
(`export_hf.llama_weights`). Rules:

- at least 2 inputs; linear weights must sum to 1 (within 1e-6) unless `normalize` (then each is divided
  by their sum, which must not be 0); negative weights are allowed (extrapolation);
- every input has the first's model config (hidden size, layers, heads, KV heads, FFN, vocab, tied
  embeddings, RoPE θ, norm eps, max positions: the first differing key is named) and the same tensors
  with the same shapes (the first differing tensor is named: e.g. a different vocabulary padding);
- per tensor: sum of weight × tensor in float64, inputs in the order given, cast to the first input's
  dtype (a precision differing from the first's is warned about);
- tokenizer: the first input's is carried (its dataset tokenizer `meta.tokenizer`, with the dataset's chat
  template, and/or the `hf/` files an imported checkpoint carries); a different tokenizer in a later
  input is a warning.

The result is written like `train ckpt import` (`import_worker.write_checkpoint`, a subprocess): OUT/
step_00000000 + `latest`, TP1 PP1, no optimizer, the first input's model config (vocabulary padding kept:
make_vocab_size_divisible_by is raised when the first was saved at TP > 1). Its manifest's `meta.merge`
records the provenance: method, whether weights were normalized, and per input its path, name, step,
given and used weight, xxh3_128 of its manifest.json (which lists every file's checksum), and its own
`meta.merge` when it was itself a merge.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import fsspec
import xxhash

from storage.config import ConfigError
from train.checkpoint import layout
from train.checkpoint.layout import CheckpointError

SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
              "tie_embeddings", "rope_theta", "norm_eps", "max_position_embeddings", "no_rope_every")
TOLERANCE = 1e-6


class MergeError(CheckpointError):
    """Inputs that cannot be merged; the message names the checkpoint, key or tensor."""


def parse_inputs(method: str, args: list[str], normalize: bool = False) -> list[tuple[str, float, float]]:
    """(path, weight used, weight given) per input. `args` are paths (soup) or PATH:WEIGHT (linear)."""
    if method not in ("linear", "soup"):
        raise MergeError(f"unknown merge method {method!r} (linear or soup)")
    if len(args) < 2:
        raise MergeError(f"--{method} needs at least 2 checkpoints to merge, got {len(args)}")
    if method == "soup":
        return [(a, 1.0 / len(args), 1.0 / len(args)) for a in args]
    pairs = []
    for a in args:
        path, sep, w = a.rpartition(":")
        try:
            weight = float(w) if sep and path else math.nan
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise MergeError(f"--linear input {a!r}: give CHECKPOINT:WEIGHT with a finite number (e.g. run/ckpt:0.9)")
        pairs.append((path, weight))
    total = math.fsum(w for _, w in pairs)
    if abs(total - 1.0) > TOLERANCE:
        if not normalize:
            raise MergeError(f"--linear weights sum to {total:g}, not 1 "
                             f"({' + '.join(f'{w:g}' for _, w in pairs)}); fix them or pass --normalize "
                             "to divide each by their sum")
        if total == 0:
            raise MergeError("--linear weights sum to 0: --normalize cannot divide by it")
        return [(p, w / total, w) for p, w in pairs]
    return [(p, w, w) for p, w in pairs]


def _digest(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def tokenizer_digest(ckpt: str, manifest: dict) -> tuple[str | None, str | None]:
    """(where the checkpoint's tokenizer.json is, xxh3_128 of it): its carried `hf/` file, else the dataset
    tokenizer it records; (None, None) when it has none."""
    from storage.fs import read_bytes
    from train.checkpoint.export_hf import carried_dir

    carried = carried_dir(ckpt, manifest)
    path = os.path.join(carried, "tokenizer.json") if carried else None
    if not (path and os.path.isfile(path)):
        path = (manifest.get("meta") or {}).get("tokenizer")
    if not path:
        return None, None
    try:
        return path, _digest(read_bytes(path))
    except Exception as e:  # noqa: BLE001 - an unreadable tokenizer only weakens the comparison
        return path, f"unreadable ({type(e).__name__})"


def _model(ckpt: str, m: dict):
    from train.model.gpt import ModelConfig

    meta = (m.get("meta") or {}).get("model")
    if not meta:
        raise MergeError(f"{ckpt}: its manifest records no model config (meta.model)")
    known = set(ModelConfig.__dataclass_fields__)
    cfg = ModelConfig(**{k: v for k, v in meta.items() if k in known}).resolved()
    if cfg.moe.enabled:
        raise MergeError(f"{ckpt}: a mixture-of-experts checkpoint ({cfg.moe.num_experts} experts); merges do not "
                         "support MoE yet")
    return cfg


def _output_shape(ckpt: str, m: dict) -> dict:
    """The merged checkpoint's model config: the first input's, with the TP1 padding giving its rows."""
    import dataclasses

    cfg = _model(ckpt, m)
    tp = int((m.get("layout") or {}).get("tp") or 1)
    rows = (m.get("meta") or {}).get("padded_vocab_size") or cfg.padded_vocab_size(tp)
    if cfg.padded_vocab_size(1) != rows:
        cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by * tp)
        if cfg.padded_vocab_size(1) != rows:
            raise MergeError(f"{ckpt}: embedding has {rows} rows, which no vocabulary padding of "
                             f"vocab_size {cfg.vocab_size} at TP1 gives")
    return dataclasses.asdict(cfg)


def make_plan(pairs: list[tuple[str, float, float]], method: str, normalized: bool) -> tuple[dict, list[str]]:
    """Resolve and verify the inputs, compare their model configs and tokenizers; returns (the plan the
    worker runs, warnings)."""
    from train.checkpoint.export_hf import carried_dir
    from train.checkpoint.init_from import find_checkpoint

    fs, inputs, warnings = fsspec.filesystem("file"), [], []
    for i, (arg, weight, given) in enumerate(pairs):
        try:
            ck = find_checkpoint(arg, what=f"merge input {i + 1}")
        except ConfigError as e:
            raise MergeError(str(e)) from None
        m = layout.read_manifest(fs, ck)
        with open(os.path.join(ck, layout.MANIFEST), "rb") as f:
            digest = _digest(f.read())
        tok_path, tok_digest = tokenizer_digest(ck, m)
        rec = {"checkpoint": ck, "name": m.get("name"), "step": m.get("step"), "weight": weight, "given": given,
               "manifest_xxh3_128": digest, "tokenizer": tok_path, "tokenizer_xxh3_128": tok_digest}
        if (m.get("meta") or {}).get("merge"):
            rec["merged_from"] = m["meta"]["merge"]
        inputs.append((rec, m))
    (first, fm), ref = inputs[0], _model(inputs[0][0]["checkpoint"], inputs[0][1])
    for rec, m in inputs[1:]:
        other = _model(rec["checkpoint"], m)
        for k in SHAPE_KEYS:
            a, b = getattr(ref, k), getattr(other, k)
            if a != b:
                raise MergeError(f"model configs differ: key 'model.{k}' is {a!r} in {first['checkpoint']}, "
                                 f"{b!r} in {rec['checkpoint']}")
        if rec["tokenizer_xxh3_128"] != first["tokenizer_xxh3_128"]:
            warnings.append(f"the tokenizer of {rec['checkpoint']} ({rec['tokenizer'] or 'none recorded'}) differs "
                            f"from that of {first['checkpoint']} ({first['tokenizer'] or 'none recorded'}); "
                            "the merged checkpoint carries the first's")
        pa, pb = ((x.get("meta") or {}).get("precision", "fp32") for x in (fm, m))
        if pa != pb:
            warnings.append(f"{rec['checkpoint']} has precision {pb}, {first['checkpoint']} {pa}: "
                            f"the merge is cast to {pa}")
    fmeta = fm.get("meta") or {}
    meta = {"merge": {"method": method, "normalized": normalized, "inputs": [r for r, _ in inputs]}}
    for key in ("seq_len", "tokenizer"):
        if fmeta.get(key):
            meta[key] = fmeta[key]
    carry = carried_dir(first["checkpoint"], fm)
    if carry:
        meta["hf"] = dict(fmeta["hf"])
    plan = {"inputs": [(r["checkpoint"], r["weight"]) for r, _ in inputs],
            "shape": _output_shape(first["checkpoint"], fm), "meta": meta, "carry": carry}
    return plan, warnings


def check_same_tensors(ref: dict[str, tuple], hf: dict, a: str, b: str) -> None:
    """Raise MergeError naming the first tensor (sorted by name) that `b` lacks, adds, or shapes otherwise."""
    for k in sorted(set(ref) | set(hf)):
        if k not in hf:
            raise MergeError(f"tensor {k!r} is in {a} but not in {b}")
        if k not in ref:
            raise MergeError(f"tensor {k!r} is in {b} but not in {a}")
        if tuple(hf[k].shape) != ref[k]:
            raise MergeError(f"tensor {k!r} has shape {ref[k]} in {a}, {tuple(hf[k].shape)} in {b}"
                             + (" (the vocabulary is padded differently: saved at another TP or "
                                "make_vocab_size_divisible_by?)" if "embed" in k or "lm_head" in k else ""))


def average(inputs: list[tuple[str, float]]) -> dict:
    """Σ weight × tensor per Llama-named tensor, in float64 in the order given, cast to the first's dtype."""
    from train.checkpoint.export_hf import llama_weights

    acc, dtypes, shapes, first = {}, {}, {}, None
    for path, w in inputs:
        hf, _, _ = llama_weights(path)
        if first is None:
            first = path
            dtypes = {k: v.dtype for k, v in hf.items()}
            shapes = {k: tuple(v.shape) for k, v in hf.items()}
            acc = {k: v.double() * w for k, v in hf.items()}
        else:
            check_same_tensors(shapes, hf, first, path)
            for k, v in hf.items():
                acc[k].add_(v.double() * w)
        del hf
    return {k: acc.pop(k).to(dtypes[k]) for k in list(acc)}


def run_plan(plan: dict, out_root: str, write) -> str:
    """In the worker: average the inputs and write them with `write` (import_worker.write_checkpoint)."""
    hf = average([(p, float(w)) for p, w in plan["inputs"]])
    return write(hf, plan["shape"], out_root, plan["meta"], carry=plan["carry"])


def merge(method: str, args: list[str], out_root: str, normalize: bool = False,
          timeout: float | None = None) -> tuple[str, list[str], dict]:
    """Merge the checkpoints `args` into OUT_ROOT/step_00000000; returns (its path, warnings, the plan).
    Arguments and inputs are checked here first, so bad ones fail fast, without starting megatron."""
    pairs = parse_inputs(method, list(args), normalize)
    out_root = os.path.abspath(out_root)
    if os.path.isdir(out_root) and any(n.startswith("step_") for n in os.listdir(out_root)):
        raise MergeError(f"{out_root}: already holds checkpoints; give an empty or new folder")
    plan, warnings = make_plan(pairs, method, normalized=any(w != g for _, w, g in pairs))
    return run_worker("--merge", out_root, plan, timeout, MergeError, "merge"), warnings, plan


def run_worker(mode: str, out_root: str, plan: dict, timeout: float | None, error: type[Exception], what: str) -> str:
    """Run train.checkpoint.import_worker `mode` (--merge, --prune) on `plan` in a subprocess (megatron writes
    the checkpoint); returns the path it prints last. Its one-line errors (exit 2) raise `error` as they are,
    anything else with the tail of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    r = subprocess.run([sys.executable, "-m", "train.checkpoint.import_worker", mode, out_root],
                       input=json.dumps(plan), env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        errors = [ln[len("error: "):] for ln in r.stderr.splitlines() if ln.startswith("error: ")]
        if r.returncode == 2 and errors:
            raise error(errors[-1])
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise error(f"{what} into {out_root} failed:\n{tail}")
    return r.stdout.strip().splitlines()[-1]
