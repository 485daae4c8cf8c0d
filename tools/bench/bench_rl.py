"""RL on the trainer against TRL 1.16's GRPOTrainer, and the reward model's held-out accuracy, in one run.

- GRPO, both sides on the same model (a checkpoint of `make demo`, e.g. its merged chat model, exported to
  a HF folder for TRL), the same arithmetic prompts (datapipe.demo.arithmetic_prompts, chat template
  applied), group size, completion budget, rewards (math-verify + format) and learning rate, one process
  on the same cores; steps timed per optimizer step after --skip warm-up steps, alternating rounds, median:
  samples (completions) per second. Ours also reports its step time split into generation, scoring and
  update, and the update's tokens/s against an SFT step of `train launch` on rows of the same shape.
- Reward model: `objective: reward` from the SFT checkpoint on the demo's preference pairs (SciQ and
  repetition pairs, a fifth held out) for --rm-steps steps: held-out pair accuracy and its standard error,
  overall and per source.

    python tools/bench/bench_rl.py [--demo-out demo-out] [--steps 12] [--skip 2] [--rounds 2]
                                   [--rm-steps 60] [--append docs/benchmarks-history.md]
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
import tempfile
import time
from pathlib import Path

import yaml

G, PROMPTS, MICRO, NEW, LR = 8, 8, 4, 6, 5e-4
PATTERN = r"^\s*-?\d"


def _newest(ckpt_dir: Path) -> Path:
    return ckpt_dir / (ckpt_dir / "latest").read_text().strip()


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def prompts_dataset(work: Path, tokenizer: Path) -> tuple[Path, Path]:
    from datapipe.demo import arithmetic_prompts

    src = work / "arith.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_prompts(400, seed=7, max_operand=20)))
    build = {"output": str(work / "arith"), "tokenizer": {"path": str(tokenizer)}, "validation": {"fraction": 0.2},
             "sources": [{"name": "arith", "paths": [str(src)], "format": "prompts",
                          "chat": {"template": "chatml", "max_tokens": 64}}]}
    (work / "arith.yaml").write_text(yaml.safe_dump(build))
    _run([sys.executable, "-m", "datapipe.cli", "build", "--quiet", str(work / "arith.yaml")])
    return work / "arith", src


def _train(work: Path, name: str, cfg: dict, init: Path) -> list[dict]:
    run = work / f"{name}-{time.time_ns()}"
    (work / f"{name}.yaml").write_text(yaml.safe_dump({**cfg, "run_dir": str(run)}))
    _run([sys.executable, "-m", "train.cli", "launch", str(work / f"{name}.yaml"), "--nproc", "1", "--init", str(init)])
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def ours(work: Path, ds: Path, init: Path, args) -> dict:
    cfg = {"objective": "grpo", "steps": args.steps, "seed": 1, "model": {"preset": "tiny"},
           "data": {"dataset": str(ds), "seq_len": 128, "seed": 1},
           "parallel": {"global_batch_size": PROMPTS, "micro_batch_size": MICRO},
           "optim": {"lr": LR, "min_lr": LR, "warmup_steps": 0, "schedule": "constant"},
           "rl": {"group_size": G, "max_new_tokens": NEW, "rewards": [{"name": "math"},
                                                                  {"name": "format", "pattern": PATTERN,
                                                                   "weight": 0.5}], "eval_prompts": 0},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 0, "incremental_every": 0}}
    recs = [r for r in _train(work, "grpo", cfg, init) if "loss" in r][args.skip:]
    step = statistics.median(r["step_time_s"] for r in recs)
    return {"samples_per_s": PROMPTS * G / step, "step_s": step,
            "generation_s": statistics.median(r["generation_s"] for r in recs),
            "sync_s": statistics.median(r["sync_s"] for r in recs),
            "scoring_s": statistics.median(r["rollout_s"] - r["generation_s"] - r["sync_s"] for r in recs),
            "update_s": statistics.median(r["update_s"] for r in recs),
            "row_width": statistics.median(r["row_width"] for r in recs),
            "update_tokens_per_s": statistics.median(PROMPTS * G * r["row_width"] / r["update_s"] for r in recs),
            "reward_first": recs[0]["reward"], "reward_last": recs[-1]["reward"]}


def sft_step(work: Path, chat: Path, init: Path, width: int, args) -> dict:
    """An SFT step of `train launch` on rows of the RL update's shape: PROMPTS×G packed rows of `width`, one
    sequence per row as the update's (document masking off), timed without its data wait as the update is."""
    cfg = {"objective": "sft", "steps": args.steps, "seed": 1, "model": {"preset": "tiny"},
           "data": {"dataset": str(chat), "seq_len": width, "seed": 1, "document_masking": False},
           "parallel": {"global_batch_size": PROMPTS * G, "micro_batch_size": MICRO * G},
           "optim": {"lr": 1e-5, "min_lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 0, "incremental_every": 0}}
    recs = [r for r in _train(work, "sft", cfg, init) if "loss" in r][args.skip:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] / (1.0 - r["data_wait_share"]) for r in recs)}


def trl_worker(folder: str, src: str, steps: int, skip: int) -> dict:
    """In a fresh process: TRL's GRPOTrainer, same model, prompts, group, budget, rewards, lr."""
    import torch
    from datasets import Dataset as HFDataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from train.objectives.rewards import format_reward, math_reward

    torch.manual_seed(1)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = [json.loads(x) for x in Path(src).read_text().splitlines()]
    data = HFDataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                for r in rows])
    fmt = format_reward(PATTERN)

    def r_math(completions, answer, **kw):
        return math_reward(None, [c[0]["content"] for c in completions], answer)

    def r_format(completions, **kw):
        return [0.5 * v for v in fmt(None, [c[0]["content"] for c in completions], None)]

    times = []

    class Clock(TrainerCallback):  # wall time from one optimizer step's end to the next: everything in the loop
        def on_train_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            times.append(now - self.t)
            self.t = now

    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=MICRO * G,
                     gradient_accumulation_steps=PROMPTS // MICRO, num_generations=G, max_completion_length=NEW,
                     learning_rate=LR, lr_scheduler_type="constant", beta=0.0, loss_type="dapo", temperature=1.0,
                     use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=10**6,
                     dataloader_num_workers=0, seed=1)
    trainer = GRPOTrainer(model=model, reward_funcs=[r_math, r_format], args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    step = statistics.median(times[skip:])
    return {"samples_per_s": PROMPTS * G / step, "step_s": step, "trl": __import__("trl").__version__}


def trl(folder: Path, src: Path, args) -> dict:
    r = subprocess.run([sys.executable, __file__, "--trl-worker", str(folder), str(src), str(args.steps),
                        str(args.skip)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"TRL worker failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def reward_model(work: Path, prefs: Path, init: Path, steps: int) -> dict:
    cfg = {"objective": "reward", "steps": steps, "seed": 1, "model": {"preset": "tiny"},
           "data": {"dataset": str(prefs), "seq_len": 256, "seed": 1},
           "parallel": {"global_batch_size": 16, "micro_batch_size": 4},
           "optim": {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 5, "schedule": "cosine"},
           "reward": {"center_coef": 0.01}, "eval": {"every": steps, "tasks": [], "validation_tokens": 0},
           "monitor": {"log_every": 10, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 0, "incremental_every": 0}}
    ev = [r for r in _train(work, "rm", cfg, init) if r.get("kind") == "eval"][-1]
    return {k.removeprefix("reward_val/"): v for k, v in ev.items() if k.startswith("reward_val/")}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        print(json.dumps(trl_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo-out", default="demo-out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rm-steps", type=int, default=60)
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    demo = Path(args.demo_out).resolve()
    work = Path(tempfile.mkdtemp(prefix="bench-rl-"))
    policy = _newest(demo / "merged" / "final") if (demo / "merged" / "final").is_dir() else \
        _newest(demo / "sft" / "checkpoints")
    sft = _newest(demo / "sft" / "checkpoints")
    ds, src = prompts_dataset(work, demo / "data" / "tokenizer.json")
    from train.checkpoint.export_hf import export

    folder = work / "hf"
    export(str(policy), str(folder))
    o, t = [], []
    for r in range(args.rounds):
        for side in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
            res = ours(work, ds, policy, args) if side == "ours" else trl(folder, src, args)
            (o if side == "ours" else t).append(res)
            print(f"round {r} {side}: {res['samples_per_s']:.1f} samples/s", flush=True)
    mine = {k: statistics.median(x[k] for x in o) for k in o[0]}
    theirs = {"samples_per_s": statistics.median(x["samples_per_s"] for x in t), "trl": t[0]["trl"]}
    sft_rate = sft_step(work, demo / "chat", sft, int(mine["row_width"]), args)
    rm = reward_model(work, demo / "prefs", sft, args.rm_steps)
    print("ours", mine, "trl", theirs, "sft", sft_rate, "rm", rm, flush=True)
    if args.append:
        cmd = "python tools/bench/bench_rl.py " + " ".join(sys.argv[1:])
        ratio = mine["samples_per_s"] / theirs["samples_per_s"]
        upd = mine["update_tokens_per_s"] / sft_rate["tokens_per_s"]
        chance_sigmas = (rm["accuracy"] - 0.5) / rm["accuracy_se"] if rm.get("accuracy_se") else float("nan")
        with open(args.append, "a") as f:
            f.write(f"""
## RL: GRPO against TRL, step time split, reward model ({datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores)

`{cmd}`: the demo's merged chat model (tiny, 4 layers), {PROMPTS} arithmetic prompts x {G} completions per step,
{NEW} new tokens, rewards math-verify + 0.5 x format, lr {LR}, loss dapo, one process each; median step of
{args.steps - args.skip} steps after {args.skip}, {args.rounds} alternating rounds.

| | samples/s | step |
|---|---|---|
| smoltrain `objective: grpo` | {mine['samples_per_s']:.1f} | {mine['step_s']:.2f} s: weight sync {mine['sync_s']:.2f} s, generation {mine['generation_s']:.2f} s, scoring {mine['scoring_s']:.3f} s, update {mine['update_s']:.2f} s |
| TRL {theirs['trl']} `GRPOTrainer` | {theirs['samples_per_s']:.1f} | |

**{ratio:.2f}x** TRL's samples/s. The update's tokens/s ({PROMPTS * G} rows x their width {mine['row_width']:.0f} / update
time) {mine['update_tokens_per_s']:,.0f} vs an SFT step of `train launch` on {PROMPTS * G} packed rows of the same
width {sft_rate['tokens_per_s']:,.0f}: {upd:.2f} of SFT's rate (the update takes logits at the completion
tokens only; it also computes their entropy and the per-token weights).

Reward model (`objective: reward`, from the SFT checkpoint, {args.rm_steps} steps on the demo's preference data: SciQ
pairs and repetition pairs): held-out accuracy {rm.get('accuracy', float('nan')):.3f} ± {rm.get('accuracy_se', float('nan')):.3f}
on {rm.get('pairs')} pairs ({chance_sigmas:.1f} standard errors above chance); per source: {_per_source(rm)}.
""")


def _per_source(rm: dict) -> str:
    names = sorted({k.split("/")[0] for k in rm if k.count("/") == 1})
    return "; ".join(f"{n} {rm[n + '/accuracy']:.3f} ± {rm[n + '/accuracy_se']:.3f} on {rm[n + '/pairs']} pairs "
                     f"({(rm[n + '/accuracy'] - 0.5) / max(rm[n + '/accuracy_se'], 1e-9):.1f} SE)"
                     for n in names) or "one source"


if __name__ == "__main__":
    main()
