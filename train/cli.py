"""The `train` command: launch (torchrun / Slurm), eval, ablate, generate, estimate, plot, ckpt."""
from __future__ import annotations

import importlib.util
import sys

import click

from storage import config as cfgmod
from storage.cliutil import config_options
from train.ablate_config import AblationConfig
from train.config import TrainConfig


@click.group()
def main() -> None:
    """Megatron-core GPT training: launch, eval, ablate, generate, estimate, plot, ckpt."""
    from train.monitor import console

    console.ignore_expected()  # megatron's "TE/Apex not installed" at import (export, generate, merge)


@main.command()
@config_options(TrainConfig)
@click.option("--nproc", type=int, default=None, help="Processes per node (default: launch.nproc, GPUs, or 1 on CPU).")
@click.option("--nnodes", type=int, default=None, help="Nodes (c10d rendezvous at launch.rdzv_endpoint).")
@click.option("--node-rank", type=int, default=None, help="This node's rank (default: assigned by c10d).")
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (multi-node).")
@click.option("--slurm", is_flag=True, help="Write RUN_DIR/train.sbatch instead of running.")
@click.option("--submit", is_flag=True, help="With --slurm: submit the script with sbatch.")
@click.option("--dry-run", is_flag=True, help="Validate, write the resolved config, print the torchrun command.")
@click.option("--init", "init", default=None, metavar="CHECKPOINT",
              help="Start from this checkpoint's weights (a step_… folder, or a run dir / checkpoints folder: its "
              "newest): fresh optimizer, LR schedule and data, step 0; any TP/PP (resharded on load). Null model "
              "shape keys are taken from it, set ones must match it. Sets the config key `init`. If RUN_DIR "
              "already has a checkpoint, the run resumes from that instead (a restarted run continues). "
              "model.rope_theta and model.max_position_embeddings may differ from it (a new stage).")
@click.option("--keep-optimizer", "keep_optimizer", is_flag=True,
              help="With --init: also load the checkpoint's optimizer state (AdamW moments and step; any TP/PP/DP, "
              "same precision and optimizer kind); the LR schedule, data order and step still start fresh. Sets "
              "the config key `init_keep_optimizer`.")
def launch(cfg: TrainConfig, config_path, nproc, nnodes, node_rank, rdzv_endpoint, slurm, submit, dry_run, init,
           keep_optimizer):
    """Validate CONFIG and train: starts torchrun itself (one process per GPU, or --nproc on CPU).
    Auto-resume: a run whose RUN_DIR has a checkpoint continues from the newest one that verifies."""
    from train import launch as launcher

    if init:
        cfg.init = init
    if keep_optimizer:
        cfg.init_keep_optimizer = True
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


@main.command("eval")
@click.argument("targets", nargs=-1, metavar="[TARGET ...]")
@click.option("--hf", "hf_folder", metavar="[LABEL=]FOLDER",
              help="Evaluate a Hugging Face folder (an export, a quantized folder) through transformers instead of a "
              "checkpoint; validation loss too when a dataset is set (--set data.dataset=DATA).")
@click.option("--table", "table_dir", type=click.Path(exists=True, file_okay=False),
              help="Print the results in DIR (a run dir's eval/, or a folder of result JSONs such as --out): one "
              "row per checkpoint (labels, in the order evaluated, if any), one column per task.")
@click.option("--tasks", default=None, help="Comma-separated task specs (default: eval.tasks, else the "
              "early-signal set); NAME=FILE.jsonl adds a task of your own.")
@click.option("--limit", type=int, default=None, help="Items per task (default eval.limit; generative tasks: "
              "eval.generation.limit, else eval.limit): a deterministic subsample spread over the task, the same items "
              "every run (each result item records its index in the task's data), or with --first the first N.")
@click.option("--first", is_flag=True, help="--limit takes each task's first N items, as lm-eval's --limit does "
              "(eval.limit_mode=first).")
@click.option("--validation-tokens", type=int, default=None, help="Held-out tokens per source (0: no validation loss).")
@click.option("--all", "every", is_flag=True, help="Every checkpoint of RUN_DIR (default: the newest); a "
              "single unlabeled RUN_DIR target only.")
@click.option("--nproc", type=int, default=1, show_default=True, help="Processes (world = TP × PP × DP).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a run config key, "
              "e.g. parallel.tp=2 (repeatable).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Train config (default: the run's config.yaml next to the first target's checkpoints).")
@click.option("--tokenizer", type=click.Path(dir_okay=False), default=None, help="tokenizer.json for the tasks.")
@click.option("--out", type=click.Path(), default=None, help="Results folder (default: RUN_DIR/eval of the "
              "first target; give one with labeled targets from several runs). With --hf: a results folder (OUT/"
              "LABEL.json, for --table beside checkpoints' results) or a .json file (default FOLDER/eval.json).")
@click.option("--metric", type=click.Choice(["acc", "acc_norm", "acc_token"]), default="acc_norm",
              show_default=True, help="With --table: the metric shown per task.")
@click.option("--unsafe-exec", is_flag=True, help="Code tasks (humaneval, mbpp) on a machine without bubblewrap: run "
              "the generated programs in bare subprocesses (same limits, no isolation). Without it they are refused.")
def eval_cmd(targets, hf_folder, table_dir, tasks, limit, first, validation_tokens, every, nproc, overrides,
             config_path, tokenizer, out, metric, unsafe_exec):
    """Evaluate checkpoints (any TP/PP layout, resharded on load), a run's checkpoints, or a HF folder:
    validation loss per source (loss, ppl, bits/byte), multiple-choice benchmarks (acc, acc_norm, acc_token),
    bits per byte of canonical answers (codex_humaneval:gold_bpb_0shot, codex_mbpp:..., minerva_math_500:...)
    and generative tasks scored as lm-eval scores them (gsm8k_cot, gsm8k_cot_chat: exact_match per filter;
    ifeval: prompt/instruction-level strict and loose accuracy; humaneval, mbpp: pass@k, the programs run in
    a bubblewrap sandbox; minerva_math_500: math_verify; every generation and execution kept in the results).
    Generation settings: --set eval.generation.max_new_tokens=N (also .stop, .chat_template, .batch_size,
    .samples and .temperature for pass@k).

    Each TARGET is CHECKPOINT|RUN_DIR (a run dir: its newest checkpoint, or every one with --all), written
    as OUT/<checkpoint>.json, or LABEL=CHECKPOINT|RUN_DIR (LABEL: letters, digits, _ . + -), written as
    OUT/LABEL.json. Several targets, e.g. the stages of a chain (pretrain, SFT, DPO, merged), are evaluated
    in one worker under one config: the first target's run config.yaml (or --config) with --set on top.

    \b
    train eval pretrain=runs/pt/checkpoints/step_450 sft=runs/sft --out chain-eval
    train eval --table chain-eval"""
    import json
    import os

    from storage.evaltasks import EARLY_SIGNAL, TaskError
    from train.eval import results

    if table_dir:
        try:
            click.echo(results.table(table_dir, metric))
        except FileNotFoundError as e:
            raise click.ClickException(str(e)) from None
        return
    task_list = [t for t in tasks.split(",") if t.strip()] if tasks else None
    if unsafe_exec:
        overrides = (*overrides, "eval.generation.unsafe_exec=true")
    if first:
        overrides = (*overrides, "eval.limit_mode=first")
    if hf_folder:
        from train.eval.hf import evaluate_hf

        try:
            click.echo(evaluate_hf(hf_folder, config_path, list(overrides), task_list, limit, validation_tokens, out))
        except (TaskError, cfgmod.ConfigError, FileNotFoundError) as e:
            raise click.UsageError(str(e)) from None
        return
    if not targets:
        raise click.UsageError("give a CHECKPOINT or RUN_DIR (or several, as LABEL=CHECKPOINT), --hf FOLDER, "
                               "or --table DIR")
    # the evaluation layout is independent of the training one: DP over --nproc unless --set says otherwise
    sets = ["parallel.tp=1", "parallel.pp=1", "parallel.micro_batch_size=1", f"parallel.global_batch_size={nproc}",
            *overrides]
    if task_list is not None:
        sets.append(f"eval.tasks={json.dumps(task_list)}")
    if limit is not None:  # every task, generative ones too
        sets += [f"eval.limit={limit}", f"eval.generation.limit={limit}"]
    if validation_tokens is not None:
        sets.append(f"eval.validation_tokens={validation_tokens}")
    try:
        ckpts, labels = results.parse_targets(targets, every)
        run_dir = results.run_dir_of(ckpts[0])
        out_dir = out or (str(run_dir / "eval") if run_dir else os.path.join(os.path.dirname(ckpts[0]), "eval"))
        shapes: dict[str, list[int]] = {}  # one evaluation process group per model shape, in target order
        for i, c in enumerate(ckpts):
            shapes.setdefault(json.dumps(results.checkpoint_model(c), sort_keys=True), []).append(i)
        rc = 0
        for idx in shapes.values():
            cfg = results.resolve_config(ckpts[idx[0]], config_path, sets)
            if task_list is None and not cfg.eval.tasks:
                cfg.eval.tasks = list(EARLY_SIGNAL)
            rc = rc or results.launch([ckpts[i] for i in idx], cfg, out_dir, nproc, tokenizer,
                                      [labels[i] for i in idx] if any(labels) else None)
    except cfgmod.ConfigError as e:
        raise click.UsageError(str(e)) from None
    sys.exit(rc)


@main.command()
@config_options(AblationConfig)
@click.option("--dry-run", is_flag=True, help="List what is built, trained and evaluated, and what would be.")
@click.option("--jobs", type=int, default=1, show_default=True, help="Runs (and evaluations) at a time here.")
@click.option("--slurm", is_flag=True, help="Build here, then run each (variant, seed) as a task of an sbatch array "
              "and the report as a job after it (OUTPUT/slurm/; with --dry-run: written, not submitted).")
@click.option("--report", "report_only", is_flag=True, help="Only the report, from the results there are.")
@click.option("--task", type=int, default=None, metavar="I", help="Run I alone (trained, evaluated): an array task.")
def ablate(cfg: AblationConfig, config_path, dry_run, jobs, slurm, report_only, task):
    """Data ablation (docs/ablate.md): every variant of a `datapipe build` config built, the train config run
    on each with every seed for the same tokens, scored on the same held-out sets and tasks; a table of means
    and standard errors, a plot per metric and a verdict per variant against the baseline. Resumable: what is
    done is skipped."""
    from train import ablate_jobs
    from train.ablate import Ablation, AblationError

    if jobs < 1:
        raise click.UsageError("--jobs: at least 1")
    try:
        ab = Ablation(cfg, click.echo)
        if task is not None:
            ablate_jobs.run_task(ab, task)
        elif report_only:
            ablate_jobs.report(ab)
        elif slurm:
            ablate_jobs.slurm(ab, dry_run)
        else:
            ablate_jobs.execute(ab, jobs, dry_run)
    except cfgmod.ConfigError as e:
        raise click.UsageError(f"{config_path}: {e}") from None
    except AblationError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("config_path", metavar="[CONFIG]", required=False, type=click.Path(dir_okay=False))
@click.option("--preset", default=None, help="Model preset (tiny, 135m, 360m, 1.7b, 3b); sets model.preset.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--gpus", type=int, default=None, help="World size (default: launch.nproc × launch.nnodes, or TP × PP).")
@click.option("--mfu", type=float, default=0.45, show_default=True, help="MFU assumed for the tokens/s figure.")
@click.option("--no-flash", is_flag=True, help="Count the attention-score activations (no fused attention).")
def estimate(config_path, preset, overrides, gpus, mfu, no_flash):
    """Parameters, FLOPs/token, memory per GPU and tokens/s for CONFIG, or for --preset NAME alone."""
    from train.monitor.estimate import estimate as est
    from train.monitor.estimate import format_estimate

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
@click.argument("model", metavar="CHECKPOINT|HF_FOLDER")
@click.option("--chat", "prompt", required=True, help="The user message (with --no-chat: the raw prompt text).")
@click.option("--system", default=None, help="A system message before the user's.")
@click.option("--no-chat", is_flag=True, help="Use the text as is: no chat template.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy; > 0: sampling.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling (with --temperature).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--draft", default=None, metavar="CHECKPOINT|HF_FOLDER",
              help="Speculative decoding: a smaller model with the same vocabulary proposes tokens, MODEL verifies "
              "them; prints the acceptance rate and the speed-up over plain generation (measured here).")
@click.option("--prompt-lookup", type=int, default=0, show_default=True, metavar="N",
              help="Speculative decoding without a draft model (greedy): up to N tokens guessed per step from the "
              "prompt's and the reply's own n-grams; prints the acceptance rate and the speed-up (measured here).")
def generate(model, prompt, system, no_chat, max_new_tokens, temperature, top_p, seed, draft, prompt_lookup):
    """Talk to a model: render the chat template around --chat, generate (greedy by default) until the
    template's end-of-turn token or EOS, print the reply. MODEL is a checkpoint (step_… folder, or a run
    dir / checkpoints folder: its newest) or a Hugging Face folder (a quantized one too). The template: the
    HF folder's (or an imported checkpoint's) tokenizer_config, else the dataset manifest's chat_template,
    else ChatML."""
    import time

    from train.generation.chat import GenerateError, generate as gen, load

    kw = dict(system=system, chat=not no_chat, max_new_tokens=max_new_tokens, temperature=temperature,
              top_p=top_p, seed=seed)
    if draft is not None and prompt_lookup:
        raise click.UsageError("--draft and --prompt-lookup: one kind of speculative decoding at a time")
    if prompt_lookup < 0 or (prompt_lookup and temperature > 0):
        raise click.UsageError("--prompt-lookup: a number of tokens >= 0, with greedy decoding (--temperature 0)")
    try:
        loaded = load(model)
        if draft is None and not prompt_lookup:
            click.echo(gen(model, prompt, loaded=loaded, **kw).text)
            return
        assistant = None
        if draft is not None:
            from train.generation.speculative import check_pair

            assistant = load(draft)
            check_pair(loaded, assistant)
        t0 = time.perf_counter()
        plain = gen(model, prompt, loaded=loaded, **kw)
        t_plain = time.perf_counter() - t0
        stats = []
        t0 = time.perf_counter()
        out = gen(model, prompt, loaded=loaded, draft=assistant, prompt_lookup=prompt_lookup, stats=stats, **kw)
        t_spec = time.perf_counter() - t0
    except GenerateError as e:
        raise click.ClickException(str(e)) from None
    click.echo(out.text)
    s = stats[0]
    same = "identical to" if out.new_ids == plain.new_ids else "differs from"
    if assistant is not None:
        calls = f"acceptance {s.acceptance:.1%} ({s.target_calls} target and {s.draft_calls} draft forward passes)"
    else:
        rate = s.accepted / s.proposed if s.proposed else 0.0
        calls = f"acceptance {rate:.1%} ({s.accepted} of {s.proposed} guesses; {s.forwards + 1} forward passes)"
    click.echo(f"[speculative] {len(out.new_ids)} tokens, {calls}; {t_spec:.2f} s vs {t_plain:.2f} s plain: "
               f"speed-up {t_plain / t_spec:.2f}x; output {same} plain generation", err=True)


@main.command()
@click.argument("reference", metavar="REFERENCE_CKPT")
@click.argument("dataset")
@click.option("--nproc", type=int, default=1, show_default=True, help="Processes (world = TP × PP × DP).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. parallel.tp=2 or precision=bf16 (repeatable).")
def refs(reference, dataset, nproc, overrides):
    """Compute the reference log-probs of every preference pair of DATASET (its training pairs and held-out
    pairs) under REFERENCE_CKPT (any layout, resharded on load), once, and store them beside the dataset
    (DATASET/refs/, keyed by the dataset's fingerprint and the checkpoint's hash; checksummed; an
    interrupted pass resumes). A `objective: dpo` run then holds one model; it also computes them itself at
    its first start when they are missing."""
    import json
    import os
    import shlex
    import subprocess
    import tempfile

    from storage import config as cfgmod
    from storage.manifest import read_manifest
    from train.checkpoint.init_from import resolve

    sets = [f"data.dataset={dataset}", f"init={reference}", "objective=dpo", "parallel.micro_batch_size=1",
            f"parallel.global_batch_size={nproc}", *overrides]
    try:
        cfg = cfgmod.load(TrainConfig, None, sets)
        resolve(cfg)
        cfg.check_world(nproc)
        cfg = cfg.resolved_for_data()
        splits = ["train"] + (["validation"] if read_manifest(dataset).validation else [])
    except cfgmod.ConfigError as e:
        raise click.UsageError(str(e)) from None
    with tempfile.TemporaryDirectory() as tmp:
        cfgmod.save(cfg, os.path.join(tmp, "config.yaml"))
        spec = os.path.join(tmp, "spec.json")
        with open(spec, "w") as f:
            json.dump({"config": os.path.join(tmp, "config.yaml"), "reference": cfg.init, "splits": splits}, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "train.objectives.refs", spec]
        click.echo("+ " + shlex.join(cmd))
        sys.exit(subprocess.call(cmd))


@main.command("teacher-cache")
@config_options(TrainConfig)
@click.option("--nproc", type=int, default=None, help="Processes (default: launch.nproc, GPUs, or 1 on CPU).")
def teacher_cache(cfg: TrainConfig, config_path, nproc):
    """Precompute the teacher's top-k logits for a distillation CONFIG (`distill.precomputed: true`): the
    teacher alone, under the config's layout, over every row the run will read; stored beside the dataset
    (DATASET/teacher/, fingerprinted, checksummed). The run then holds no teacher; `train launch` runs this
    pass itself, before training, when the cache is missing."""
    from train import launch as launcher

    if cfg.objective not in ("distill", "distill_sft") or not cfg.distill.precomputed:
        raise click.UsageError(f"{config_path}: key 'distill.precomputed': teacher-cache is for a distill or "
                               "distill_sft run with distill.precomputed: true")
    try:
        rc = launcher.launch(cfg, nproc=nproc, pass_only=True)
    except cfgmod.ConfigError as e:
        raise click.UsageError(f"{config_path}: {e}") from None
    sys.exit(rc)


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="PNG path (default RUN_DIR/metrics.png).")
def plot(run_dir, out):
    """Plot RUN_DIR/metrics.jsonl to a PNG (and in-loop evaluations to eval.png beside it)."""
    from train.monitor.plot import plot as do_plot

    try:
        path = do_plot(run_dir, out)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {path}")


if importlib.util.find_spec("train.checkpoint.cli") is not None:
    from train.checkpoint.cli import ckpt

    main.add_command(ckpt)


def entrypoint() -> None:
    """The console script: `main`, then an exit without the interpreter's teardown (storage.lifecycle)."""
    from storage.lifecycle import run_main

    run_main(main)


if __name__ == "__main__":
    entrypoint()
