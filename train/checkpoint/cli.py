"""`train ckpt list|verify|export|import|merge|prune|quantize`: inspect, check, convert and merge checkpoints (local folders
or fsspec URLs)."""
from __future__ import annotations

import os
import sys

import click
import fsspec

from storage.config import ConfigError
from storage.fs import get_fs
from train.checkpoint import layout
from train.checkpoint.layout import CheckpointError


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


@click.group("ckpt")
def ckpt() -> None:
    """Checkpoints: list, verify, export to / import from Hugging Face, merge (weight averaging), prune,
    quantize (a Hugging Face folder with int8 / int4 / GPTQ / AWQ weights)."""


@ckpt.command("list")
@click.argument("root")
def list_cmd(root: str) -> None:
    """Checkpoints under ROOT (folder or URL): step, kind, base, size, tensor bytes written vs full."""
    fs, path = get_fs(root)
    infos = {c.name: c for c in layout.list_checkpoints(fs, path)}
    latest = layout.read_latest(fs, path)
    click.echo(f"{'name':<16} {'kind':<12} {'base':<16} {'size':>11} {'written/full':>13}")
    for name in layout.checkpoint_names(fs, path):
        c = infos.get(name)
        if c is None:
            click.echo(f"{name:<16} {'BROKEN':<12} {'-':<16} {'-':>11} {'-':>13}  (no readable manifest)")
            continue
        tb = c.manifest.get("tensor_bytes", {})
        ratio = f"{100.0 * tb['written'] / tb['full']:.1f}%" if tb.get("full") else "-"
        mark = "  <- latest" if name == latest else ""
        click.echo(f"{name:<16} {c.kind:<12} {c.base or '-':<16} {_human(c.total_bytes):>11} {ratio:>13}{mark}")


@ckpt.command("verify")
@click.argument("root")
@click.argument("names", nargs=-1)
@click.option("--sizes-only", is_flag=True, help="Check presence and sizes, skip checksums.")
def verify_cmd(root: str, names: tuple[str, ...], sizes_only: bool) -> None:
    """Verify checksums of NAMES (default: every checkpoint under ROOT, with their bases). Exit 1 if any fails."""
    fs, path = get_fs(root)
    bad = 0
    for name in names or layout.checkpoint_names(fs, path):
        problems = layout.verify(fs, path, name, checksums=not sizes_only)
        if problems:
            bad += 1
            click.echo(f"FAIL {name}")
            for p in problems:
                click.echo(f"  {p}")
        else:
            click.echo(f"ok   {name}")
    if bad:
        sys.exit(1)


@ckpt.command("export")
@click.argument("checkpoint")
@click.argument("out_dir")
@click.option("--tokenizer", help="tokenizer.json to include (default: the one recorded in the checkpoint)")
@click.option("--num-heads", type=int, help="Override the model's attention heads")
@click.option("--num-kv-heads", type=int, help="Override the model's KV heads")
@click.option("--license", "license_id", help="The model card's license (a Hub license id, e.g. apache-2.0; "
              "default: other)")
@click.option("--eval", "eval_json", type=click.Path(exists=True, dir_okay=False),
              help="A `train eval` result JSON for the card (default: RUN_DIR/eval/<checkpoint>.json if present)")
def export_cmd(checkpoint: str, out_dir: str, tokenizer: str | None, num_heads: int | None,
               num_kv_heads: int | None, license_id: str | None, eval_json: str | None) -> None:
    """Export CHECKPOINT (a step_… folder) to a Hugging Face Llama folder OUT_DIR, with a model card
    (README.md: the Hub's metadata, the checkpoint's evaluation results, the training recipe)."""
    import json

    from train.checkpoint import model_card
    from train.checkpoint.export_hf import export

    if "://" in checkpoint and not checkpoint.startswith("file://"):
        raise click.UsageError("export reads a local checkpoint; pull it first (e.g. resume or fsspec cp)")
    root, name = os.path.split(os.path.abspath(checkpoint.removeprefix("file://").rstrip("/")))
    problems = layout.verify(fsspec.filesystem("file"), root, name)
    if problems:
        raise click.ClickException(f"{checkpoint} does not verify: " + "; ".join(problems[:5]))
    rec = json.loads(open(eval_json).read()) if eval_json else None
    card = model_card.build(checkpoint, license_id, rec)
    cfg = export(checkpoint, out_dir, tokenizer, {"num_heads": num_heads, "num_kv_heads": num_kv_heads}, card=card)
    click.echo(f"exported {cfg['smoltrain_checkpoint']['name']} ({cfg['num_hidden_layers']} layers, "
               f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}) to {out_dir}")


@ckpt.command("import")
@click.argument("hf_folder", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir")
def import_cmd(hf_folder: str, out_dir: str) -> None:
    """Turn a Hugging Face Llama folder (config.json, model.safetensors or sharded safetensors + index)
    into a checkpoint OUT_DIR/step_00000000 that `train eval`, `train ckpt export`, `train generate` and
    `train launch --init` accept. It records the model config and carries the tokenizer files (with the
    chat template). Refused, naming the field: other model types, rope scaling, biases, another
    activation."""
    from train.checkpoint.import_hf import import_folder

    try:
        path = import_folder(hf_folder, out_dir)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"imported {hf_folder} to {path}")


@ckpt.command("merge")
@click.argument("paths", nargs=-1, required=True, metavar="INPUT... OUT")
@click.option("--linear", "method", flag_value="linear",
              help="Weighted average; each INPUT is CHECKPOINT:WEIGHT, the weights summing to 1.")
@click.option("--soup", "method", flag_value="soup", help="Uniform average of the INPUT checkpoints.")
@click.option("--normalize", is_flag=True, help="With --linear: divide the weights by their sum instead of "
              "refusing weights that do not sum to 1.")
def merge_cmd(paths: tuple[str, ...], method: str | None, normalize: bool) -> None:
    """Average the weights of 2+ checkpoints into OUT/step_00000000 (+ latest), a checkpoint that `train
    eval`, `train ckpt export`, `train generate` and `train launch --init` accept.

    \b
      train ckpt merge --soup runs/apo-a runs/apo-b runs/apo-c soups/apo
      train ckpt merge --linear soups/apo:0.9 runs/mid/checkpoints/step_00020000:0.1 merged/final

    An INPUT is a step folder, or a run directory / checkpoints folder (its newest checkpoint that
    verifies), of any TP/PP layout. All need the same model config and tensor shapes (the first
    difference is named). Each tensor is averaged in float64 and cast to the first input's dtype. The
    first input's tokenizer (dataset tokenizer and chat template, or carried hf/ files) is carried; a
    different tokenizer elsewhere is a warning. The manifest's meta.merge records the inputs, their
    manifest hashes and the weights."""
    from train.checkpoint.merge import merge

    if method is None:
        raise click.UsageError("choose --linear (CHECKPOINT:WEIGHT inputs) or --soup (uniform)")
    if len(paths) < 2:
        raise click.UsageError("give the input checkpoints and then OUT")
    try:
        path, warnings, plan = merge(method, list(paths[:-1]), paths[-1], normalize)
    except CheckpointError as e:
        raise click.ClickException(str(e)) from None
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    for ck, w in plan["inputs"]:
        click.echo(f"  {w:+.6g}  {ck}")
    click.echo(f"merged {len(plan['inputs'])} checkpoints ({method}) into {path}")


@ckpt.command("prune")
@click.argument("checkpoint")
@click.argument("out_dir")
@click.option("--width", default=None, metavar="hidden=H,ffn=F,heads=N",
              help="Width targets (any of them): hidden channels, FFN neurons per layer, query heads per layer.")
@click.option("--depth", type=int, default=None, metavar="N", help="Keep the N most important layers.")
@click.option("--data", "dataset", default=None, help="Calibration dataset (default: the one the checkpoint "
              "records); its training split is read.")
@click.option("--samples", type=int, default=256, show_default=True, help="Calibration sequences.")
@click.option("--seq-len", type=int, default=None, help="Calibration sequence length (default: the checkpoint's).")
def prune_cmd(checkpoint: str, out_dir: str, width: str | None, depth: int | None, dataset: str | None,
              samples: int, seq_len: int | None) -> None:
    """Structured pruning with Minitron's recipe into OUT_DIR/step_00000000, a checkpoint that `train eval`,
    `train ckpt export`, `train generate` and `train launch --init` (or distill.teacher) accept.

    \b
      train ckpt prune runs/x pruned/w --width hidden=96,ffn=256,heads=2
      train ckpt prune runs/x pruned/d --depth 3

    Importance comes from activations on calibration sequences: hidden channels from the RMSNorm outputs,
    FFN neurons from down_proj's input, heads from the norm of their outputs (pruned within each KV group);
    layers by the KL divergence of the model's output when each one is dropped. CHECKPOINT is a step folder
    or a run dir (its newest checkpoint), any TP/PP layout. Follow it with distillation from the original
    (objective distill, distill.teacher: CHECKPOINT) to recover the quality."""
    from train.checkpoint.prune import prune

    try:
        path = prune(checkpoint, out_dir, width, depth, dataset, samples, seq_len)
    except (CheckpointError, ConfigError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"pruned {checkpoint} into {path}")


@ckpt.command("quantize")
@click.argument("source", metavar="CKPT|HF_FOLDER")
@click.argument("out_dir")
@click.option("--scheme", type=click.Choice(["int8-weight", "int4-weight", "gptq", "awq"]), required=True,
              help="int8-weight / int4-weight: torchao weight-only (CPU or GPU); gptq / awq: llm-compressor W4A16 "
              "(needs an NVIDIA GPU: refused otherwise).")
@click.option("--group-size", type=int, default=None, help="int4-weight: values per scale (default 128 on a GPU, "
              "32 on CPU; must divide hidden and FFN sizes).")
@click.option("--data", "dataset", default=None, help="gptq / awq: calibration dataset (its training split).")
@click.option("--samples", type=int, default=128, show_default=True, help="gptq / awq: calibration sequences.")
@click.option("--seq-len", type=int, default=512, show_default=True, help="gptq / awq: calibration length.")
def quantize_cmd(source: str, out_dir: str, scheme: str, group_size: int | None, dataset: str | None, samples: int,
                 seq_len: int) -> None:
    """Write a Hugging Face folder OUT_DIR with quantized weights (a checkpoint SOURCE is exported first),
    which `train eval --hf OUT_DIR` and `train generate OUT_DIR` run; prints its size on disk.

    \b
      train ckpt quantize runs/x q/int8 --scheme int8-weight
      train ckpt quantize hf/ q/gptq --scheme gptq --data data/   # on a GPU machine"""
    from train.checkpoint.quantize import folder_bytes, quantize

    try:
        quantize(source, out_dir, scheme, group_size, dataset, samples, seq_len)
    except (CheckpointError, ConfigError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"quantized {source} ({scheme}) into {out_dir}: {folder_bytes(out_dir) / 2**20:.2f} MiB of weights")
