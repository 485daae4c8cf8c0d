"""Benchmark evaluation: `train eval`'s scorer (Megatron model, shared-context trees, length-sorted
batches) against lm-evaluation-harness's HF backend on the same weights, items and machine, in one
process run; then the share of wall time that in-loop evaluation takes in a training run.

1. Items/s. A model of the given shape is initialised by `train launch` (synthetic data, one step,
   checkpoint) and exported with `train ckpt export`; both sides score the same items (bundled cloze
   tasks whose candidates share a context, `--limit` items each). Ours: the checkpoint loaded into
   the Megatron model (1 process), then the Evaluator built (requests encoded) and run. lm-eval: its
   HFLM built on the export, then `simple_evaluate` on a local task holding the same items. Model
   loading is outside both timings. Alternating runs, medians of --runs; per-candidate log-likelihoods
   are compared as a check that both sides did the same work.
2. Eval share. `datapipe build` on ../shared/corpora (held-out split on), then `train launch` of
   --train-steps steps with eval.every 100, eval.limit 200 and the playbook's early-signal tasks;
   share = eval wall time (logged per evaluation) / the training run's wall time.

    python tools/bench/bench_eval.py [--runs 3] [--limit 200] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from train.model import cpu_compat  # noqa: E402  (before megatron is imported anywhere)

cpu_compat.install()
CORPORA = REPO.parent / "shared" / "corpora"
TASKS = "hellaswag,arc_easy,piqa,arc_challenge:rc_5shot"


def _cli(args: list[str], env: dict | None = None) -> None:
    r = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})})
    if r.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def make_model(work: Path, shape: dict) -> tuple[Path, Path, Path]:
    """(checkpoint, HF export, tokenizer) of a freshly initialised model of `shape`."""
    import yaml

    from datapipe.tokenize import train_bpe
    from storage.evaltasks import load_task

    texts = [r.context + r.continuation for t in ("hellaswag", "arc_easy", "piqa")
             for it in load_task(t, 300).items for r in it.requests[:1]]
    tok = Path(train_bpe(texts, shape["vocab_size"], "<|endoftext|>", str(work / "tokenizer.json")))
    cfg = {"run_dir": str(work / "run"), "steps": 1, "model": {"preset": "tiny", **shape},
           "data": {"seq_len": 128}, "parallel": {"micro_batch_size": 1, "global_batch_size": 1},
           "checkpoint": {"full_every": 1, "incremental_every": 0, "async_save": False},
           "monitor": {"tensorboard": False}, "debug": {"synthetic_data": True}}
    (work / "init.yaml").write_text(yaml.safe_dump(cfg))
    _cli(["train.cli", "launch", str(work / "init.yaml")])
    ckpt = work / "run" / "checkpoints" / "step_00000001"
    _cli(["train.cli", "ckpt", "export", str(ckpt), str(work / "hf"), "--tokenizer", str(tok)])
    return ckpt, work / "hf", tok


def ours_setup(ckpt: Path):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from storage import config as cfgmod
    from train.model import parallel
    from train.checkpoint.resume import load_into
    from train.config import TrainConfig
    from train.model.gpt import build_model
    from train.state import TrainState

    cfg = cfgmod.load(TrainConfig, str(ckpt.parents[1] / "config.yaml"), [])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
    par = parallel.init(cfg)
    chunks = build_model(cfg.model, tp=1, pp=1, seed=cfg.seed)
    load_into(TrainState(model=chunks, optimizer=None, scheduler=None, loader=None), str(ckpt.parent), ckpt.name,
              cfg.checkpoint, restore_rng=False)
    assert dist.is_initialized() and ps.model_parallel_is_initialized()
    return cfg, chunks, par


def ours_run(chunks, par, tok: Path, tasks: list, max_length: int) -> tuple[float, dict]:
    """Evaluator construction (request encoding, tree rows) and scoring, on already loaded task items."""
    from tokenizers import Tokenizer

    from train.eval.evaluator import Evaluator
    from train.eval.scorer import Scorer

    eos = Tokenizer.from_file(str(tok)).token_to_id("<|endoftext|>")
    t0 = time.perf_counter()
    ev = Evaluator(Scorer(chunks, par), tasks=tasks, tokenizer_path=str(tok), eos_id=eos, max_length=max_length,
                   validation=None)
    _, details = ev.run()
    return time.perf_counter() - t0, details


def lmeval_run(lm, items_by_task: dict, work: Path) -> tuple[float, dict]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from train.eval.lmeval import offline, write_task

    names = {t: write_task(t, items, str(work / "lmeval")) for t, items in items_by_task.items()}
    with offline():
        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(model=lm, tasks=list(names.values()), log_samples=True, bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=str(work / "lmeval"),
                                                               include_defaults=False))
        dt = time.perf_counter() - t0
    out = {}
    for t, name in names.items():
        ll = [None] * len(items_by_task[t])
        for s in res["samples"][name]:
            ll[int(s["doc"]["idx"])] = [float(r[0]) for r in s["filtered_resps"]]
        out[t] = ll
    return dt, out


def eval_share(work: Path, steps: int) -> dict:
    import yaml

    src = CORPORA / "pydoc.jsonl.gz"
    build = {"output": str(work / "data"), "sources": [{"name": "docs", "paths": [str(src)], "filters": []}],
             "validation": {"fraction": 0.01}, "tokenizer": {"vocab_size": 8192}}
    (work / "build.yaml").write_text(yaml.safe_dump(build))
    _cli(["datapipe.cli", "build", str(work / "build.yaml"), "--workers", "2"])
    cfg = {"run_dir": str(work / "share"), "steps": steps, "model": {"preset": "tiny"},
           "data": {"dataset": str(work / "data"), "seq_len": 256},
           "parallel": {"micro_batch_size": 4, "global_batch_size": 16}, "monitor": {"log_every": 20},
           "checkpoint": {"full_every": 0, "incremental_every": 0},
           "eval": {"every": 100, "limit": 200, "validation_tokens": 65536,
                    "tasks": ["hellaswag", "arc_easy", "arc_challenge", "piqa", "socialiqa", "csqa", "openbookqa",
                              "winogrande", "boolq", "sciq", "mmlu"]}}
    (work / "share.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    _cli(["train.cli", "launch", str(work / "share.yaml")], env={"OMP_NUM_THREADS": "2"})
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (work / "share" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if r.get("kind") == "eval"]
    eval_s = sum(r["eval_time_s"] for r in evals)
    return {"wall_s": wall, "eval_s": eval_s, "evals": len(evals), "share": eval_s / wall,
            "per_eval_s": eval_s / max(1, len(evals))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit", type=int, default=200, help="items per task")
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--work", default="/tmp/bench_eval")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import shutil

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shape = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": 4, "num_kv_heads": 2,
             "ffn_hidden_size": args.hidden * 11 // 4, "vocab_size": 8192}
    ckpt, hf, tok = make_model(work, shape)

    from lm_eval.models.huggingface import HFLM

    from storage.evaltasks import load_task

    tasks = args.tasks.split(",")
    loaded = [load_task(t, args.limit) for t in tasks]
    items = {t.name: t.items for t in loaded}
    n_items = sum(len(v) for v in items.values())
    n_cands = sum(len(it.requests) for v in items.values() for it in v)
    cfg, chunks, par = ours_setup(ckpt)
    import torch

    torch.set_num_threads(2)
    lm = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=32)
    ours_t, peer_t, worst = [], [], 0.0
    for _ in range(args.runs):
        dt, det = ours_run(chunks, par, tok, loaded, cfg.model.resolved().max_position_embeddings)
        ours_t.append(dt)
        dt, ref = lmeval_run(lm, items, work)
        peer_t.append(dt)
        worst = max(worst, max(abs(a - b) for t in items for la, lb in zip(det[t]["logliks"], ref[t])
                               for a, b in zip(la, lb)))
    from train.model import parallel

    parallel.shutdown()
    ours_m, peer_m = statistics.median(ours_t), statistics.median(peer_t)
    share = eval_share(work, args.train_steps)
    lines = [
        f"## evaluation: `train eval` scorer vs lm-eval HF backend ({datetime.date.today()})", "",
        f"Command: `python tools/bench/bench_eval.py --runs {args.runs} --limit {args.limit}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}; "
        f"torch threads 2; load average {os.getloadavg()[0]:.1f}.  ",
        f"Model: Llama shape hidden {args.hidden}, {args.layers} layers, 4 heads (2 KV), vocab 8192, fp32, random "
        f"init (same weights on both sides: our checkpoint and its `train ckpt export`).  ",
        f"Items: {args.tasks} at `--limit {args.limit}`: {n_items} items, {n_cands} candidates. Timings exclude "
        "model loading and reading the task files; ours includes encoding the requests, lm-eval's building its "
        "task and encoding.", "",
        "| side | median s | items/s | runs (s) |", "|---|---|---|---|",
        f"| ours (Megatron, shared-context trees, 1 process) | {ours_m:.2f} | {n_items / ours_m:.1f} | "
        f"{', '.join(f'{x:.2f}' for x in ours_t)} |",
        f"| lm-eval 0.4 HF backend (batch 32) | {peer_m:.2f} | {n_items / peer_m:.1f} | "
        f"{', '.join(f'{x:.2f}' for x in peer_t)} |", "",
        f"**Ratio (items/s, ours / lm-eval): {peer_m / ours_m:.2f}x.** Largest per-candidate log-likelihood "
        f"difference between the two: {worst:.2e}.", "",
        f"Eval share of a training run (`train launch`, tiny preset, seq 256, global batch 16, {args.train_steps} "
        f"steps, eval.every 100, eval.limit 200, the 11 early-signal tasks + validation loss, 1 process): "
        f"{share['evals']} evaluations, {share['per_eval_s']:.1f} s each, {share['eval_s']:.1f} s of "
        f"{share['wall_s']:.1f} s wall = **{100 * share['share']:.1f} %**.", ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        with open(REPO / "docs" / "benchmarks-history.md", "a") as f:
            f.write("\n" + text)
        print("appended to docs/benchmarks-history.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
