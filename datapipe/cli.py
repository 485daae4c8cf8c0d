"""The `datapipe` command: build a dataset, train a tokenizer, rewrite a mix, report on a dataset."""
from __future__ import annotations

import os

import click

from datapipe.config import BuildConfig, MixCommandConfig
from datapipe.quality.annotate import command as annotate_command
from datapipe.quality.commands import classifier as classifier_group
from storage import config as cfgmod
from storage.cliutil import config_options, die
from storage.config import ConfigError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Raw text → filtered, deduplicated, tokenized LZ4 WebDataset shards with a mix schedule."""


@main.command()
@config_options(BuildConfig, config_required=False)
@click.option("--workers", type=int, default=None, help="Local worker processes (default: executor.workers).")
@click.option("--fresh", is_flag=True, help="Discard intermediate results of an earlier (interrupted) build.")
@click.option("--dry-run", is_flag=True, help="Slurm only: write the sbatch scripts, do not submit them.")
@click.option("--wait", is_flag=True, help="Slurm only: wait for the jobs, retry failed ones (executor.slurm.wait).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def build(cfg, config_path, workers, fresh, dry_run, wait, quiet) -> None:
    """Build a dataset from CONFIG (with no CONFIG: the embedded stdlib demo corpus)."""
    from datapipe.pipeline import Build
    from datapipe.report import summary_lines
    from storage.manifest import read_manifest

    if not cfg.sources:
        from datapipe.demo import demo_config

        click.echo(f"no sources configured: building the embedded demo corpus into {cfg.output}", err=True)
        cfg = demo_config(cfg.output, base=cfg)
    cfg.executor.slurm.wait |= wait
    try:
        b = Build(cfg, workers=workers, fresh=fresh)
    except ConfigError as e:  # a key checked against the inputs or the filters' own signatures
        die(f"{config_path or '<defaults>'}: {e}")
    except (FileNotFoundError, KeyError, ValueError) as e:
        die(str(e).strip("'\""))
    cfgmod.save(cfg, os.path.join(b.work, "resolved_config.yaml"))
    try:  # a failed task: one line naming it and its log (the traceback is in the log)
        if cfg.executor.kind == "slurm":
            scripts = b.submit_slurm(dry_run=dry_run, progress=not quiet)
            click.echo(f"{'wrote' if dry_run else 'submitted'} {len(scripts)} sbatch scripts under {b.work}/slurm")
            if dry_run or not cfg.executor.slurm.wait:
                return
            summary = summary_lines(read_manifest(cfg.output))
        else:
            res = b.run(progress=not quiet)
            summary = summary_lines(res.manifest, res.elapsed_s)
    except RuntimeError as e:
        die(str(e))
    for line in summary:
        click.echo(line)
    click.echo(f"dataset written to {cfg.output}")


@main.command()
@config_options(BuildConfig)
@click.option("--nodes", type=int, default=1, show_default=True, help="Machines the build will run on.")
@click.option("--cpus-per-node", type=int, default=os.cpu_count(), show_default=True, help="Worker CPUs per node.")
@click.option("--sample-mb", type=float, default=32.0, show_default=True,
              help="Input sample to build for real and scale from.")
def plan(cfg, config_path, nodes, cpus_per_node, sample_mb) -> None:
    """Predict wall time, CPU-hours, scratch and output of building CONFIG on NODES x CPUS, from a real
    build of a sample of its input (see docs/datapipe.md, Scaling)."""
    from datapipe.plan import format_plan, make_plan

    if not cfg.sources:
        die("plan needs a CONFIG with sources")
    try:
        p = make_plan(cfg, nodes, cpus_per_node, sample_mb, progress=True)
    except (FileNotFoundError, KeyError, ConfigError, ValueError) as e:
        die(str(e).strip("'\""))
    for line in format_plan(p, nodes, cpus_per_node):
        click.echo(line)


@main.group()
def tokenizer() -> None:
    """Tokenizer tools."""


@tokenizer.command("train")
@click.argument("sources", nargs=-1, required=True)
@click.option("--vocab-size", type=int, required=True, help="Vocabulary size, special tokens included.")
@click.option("--output", "-o", default="tokenizer.json", show_default=True, help="Where to write tokenizer.json.")
@click.option("--text-field", default="text", show_default=True, help="Text field of JSONL/Parquet inputs.")
@click.option("--eos-token", default="<|endoftext|>", show_default=True)
@click.option("--max-docs", type=int, default=200_000, show_default=True)
def tokenizer_train(sources, vocab_size, output, text_field, eos_token, max_docs) -> None:
    """Train a byte-level BPE on SOURCES (paths/globs of JSONL, Parquet or text files), offline."""
    from datapipe.config import SourceConfig
    from datapipe.inputs import expand_sources
    from datapipe.sources import SourceReader
    from datapipe.tokenize import train_bpe

    src = SourceConfig("train", list(sources), text_field=text_field)
    try:
        files = expand_sources([src])
    except FileNotFoundError as e:
        die(str(e))
    reader = SourceReader(files, {"train": src}, rejects=os.devnull, max_chars=10**9)

    def texts():
        n = 0
        for r, f in enumerate(files):
            for _, text, _, err, *_ in reader._records(f, src):
                if err is None and text.strip():
                    yield text
                    n += 1
                    if n >= max_docs:
                        return

    train_bpe(texts(), vocab_size, eos_token, output)
    click.echo(f"wrote {output} (vocab {vocab_size:,})")


@main.command()
@config_options(MixCommandConfig)
def mix(cfg, config_path) -> None:
    """Rewrite the mix schedule of an existing dataset from CONFIG (dataset: PATH, mix: {...})."""
    from datapipe.buildstats import rewrite_mix
    from storage.manifest import validate_mix

    try:
        m = rewrite_mix(cfg.dataset, cfg.mix)
        validate_mix(m.mix, m.sources)
    except (ConfigError, FileNotFoundError) as e:
        die(f"{config_path}: {e}")
    for ph in m.mix:
        click.echo(f"phase {ph.name}: {ph.tokens:,} tokens; " + ", ".join(f"{k}={v:g}" for k, v in ph.weights.items()))


@main.command()
@click.argument("dataset")
@click.option("--charts", "charts_dir", default=None, help="Folder for PNG charts (default: DATASET/report).")
@click.option("--no-charts", is_flag=True)
def report(dataset, charts_dir, no_charts) -> None:
    """Print DATASET's build summary (docs per stage, drops per filter, documents per language, tokens per
    source) and draw charts."""
    from datapipe.report import charts, read_elapsed, summary_lines
    from storage.manifest import read_manifest

    try:
        m = read_manifest(dataset)
    except FileNotFoundError as e:
        die(str(e))
    for line in summary_lines(m, read_elapsed(dataset)):
        click.echo(line)
    if not no_charts:
        for p in charts(m, charts_dir or os.path.join(dataset, "report")):
            click.echo(f"chart: {p}")


main.add_command(annotate_command)  # `datapipe annotate`: the command and its logic in datapipe.quality.annotate
main.add_command(classifier_group)  # `datapipe classifier train|score`: datapipe.quality.commands


def entrypoint() -> None:
    """The console script: `main`, then an exit without the interpreter's teardown (storage.lifecycle)."""
    from storage.lifecycle import run_main

    run_main(main)


if __name__ == "__main__":
    entrypoint()
