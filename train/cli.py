"""The `train` command: launch (torchrun / Slurm), estimate, plot."""
from __future__ import annotations

import importlib.util
import sys

import click

from storage import config as cfgmod
from storage.cliutil import config_options
from train.config import TrainConfig


@click.group()
def main() -> None:
    """Megatron-core GPT training: launch, estimate, plot."""


@main.command()
@config_options(TrainConfig)
@click.option("--nproc", type=int, default=None, help="Processes per node (default: launch.nproc, GPUs, or 1 on CPU).")
@click.option("--nnodes", type=int, default=None, help="Nodes (c10d rendezvous at launch.rdzv_endpoint).")
@click.option("--node-rank", type=int, default=None, help="This node's rank (default: assigned by c10d).")
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (multi-node).")
@click.option("--slurm", is_flag=True, help="Write RUN_DIR/train.sbatch instead of running.")
@click.option("--submit", is_flag=True, help="With --slurm: submit the script with sbatch.")
@click.option("--dry-run", is_flag=True, help="Validate, write the resolved config, print the torchrun command.")
def launch(cfg: TrainConfig, config_path, nproc, nnodes, node_rank, rdzv_endpoint, slurm, submit, dry_run):
    """Validate CONFIG and train: starts torchrun itself (one process per GPU, or --nproc on CPU)."""
    from train import launch as launcher

    if rdzv_endpoint:
        cfg.launch.rdzv_endpoint = rdzv_endpoint
    try:
        if slurm:
            path = launcher.slurm(cfg, submit)
            click.echo(f"wrote {path}" + (" and submitted it" if submit else ""))
            return
        rc = launcher.launch(cfg, nproc=nproc, nnodes=nnodes, node_rank=node_rank, dry_run=dry_run)
    except cfgmod.ConfigError as e:
        raise click.UsageError(f"{config_path}: {e}") from None
    sys.exit(rc)


@main.command()
@click.argument("config_path", metavar="[CONFIG]", required=False, type=click.Path(dir_okay=False))
@click.option("--preset", default=None, help="Model preset (tiny, 135m, 360m, 1.7b, 3b); sets model.preset.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--gpus", type=int, default=None, help="World size (default: launch.nproc × launch.nnodes, or TP × PP).")
@click.option("--mfu", type=float, default=0.45, show_default=True, help="MFU assumed for the tokens/s figure.")
@click.option("--no-flash", is_flag=True, help="Count the attention-score activations (no fused attention).")
def estimate(config_path, preset, overrides, gpus, mfu, no_flash):
    """Parameters, FLOPs/token, memory per GPU and tokens/s for CONFIG, or for --preset NAME alone."""
    from train.estimate import estimate as est
    from train.estimate import format_estimate

    if not config_path and not preset:
        raise click.UsageError("give a CONFIG or --preset NAME")
    sets = ([f"model.preset={preset}"] if preset else []) + list(overrides)
    try:
        cfg = cfgmod.load(TrainConfig, config_path, sets)
        if preset and not config_path and not any(o.startswith("data.seq_len=") for o in overrides):
            # without a config, size the sequence like the preset's published pre-training (capped at 4096)
            cfg = cfgmod.load(TrainConfig, None, sets + [
                f"data.seq_len={min(4096, cfg.model.resolved().max_position_embeddings)}"])
        world = gpus or ((cfg.launch.nproc or 0) * cfg.launch.nnodes) or cfg.parallel.tp * cfg.parallel.pp
        e = est(cfg, world, flash_attention=not no_flash, mfu=mfu)
    except cfgmod.ConfigError as e:
        raise click.UsageError(str(e)) from None
    click.echo(format_estimate(e, cfg))


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="PNG path (default RUN_DIR/metrics.png).")
def plot(run_dir, out):
    """Plot RUN_DIR/metrics.jsonl to a PNG."""
    from train.plot import plot as do_plot

    try:
        path = do_plot(run_dir, out)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {path}")


if importlib.util.find_spec("train.checkpoint.cli") is not None:
    from train.checkpoint.cli import ckpt

    main.add_command(ckpt)


if __name__ == "__main__":
    main()
