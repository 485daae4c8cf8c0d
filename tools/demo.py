"""`make demo`: raw text → dataset (with a held-out split) → TP=2 training with in-loop evaluation and
async checkpoints → resume → eval of every checkpoint → HF export → generation → storage bench → the
table of every checkpoint's evaluation → a chat dataset → SFT from the pretrained checkpoint → a
question to the fine-tuned model (`train generate --chat`), on the embedded corpus, printing where every
output lies.

    python -m tools.demo [--out demo-out] [--steps 450] [--sft-epochs 2]
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
    model = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0].tolist())


def sft_stage(out: Path, data: Path, pretrained: Path, epochs: float) -> None:
    """Conversations from the standard library's docstrings → chat dataset (the pretraining tokenizer, which
    reserved ChatML's tokens) → SFT from the pretrained checkpoint → a question to the fine-tuned model."""
    import json

    import yaml

    from datapipe.demo import chat_docs

    chat_in, chat, sft = out / "_chat_input" / "qa.jsonl", out / "chat", out / "sft"
    chat_in.parent.mkdir(parents=True, exist_ok=True)
    chat_in.write_text("".join(json.dumps(d) + "\n" for d in chat_docs(3000)))
    build = {"output": str(chat), "tokenizer": {"path": str(data / "tokenizer.json")},
             "validation": {"fraction": 0.05},
             "sources": [{"name": "qa", "paths": [str(chat_in)], "format": "chat",
                          "chat": {"template": "chatml", "train_on": "assistant", "max_tokens": 512}}]}
    (out / "chat-build.yaml").write_text(yaml.safe_dump(build))
    step("8/9 datapipe build (format: chat): 3,000 conversations made from stdlib docstrings → ChatML, loss "
         "mask on assistant turns, shard format 2", [str(BIN / "datapipe"), "build", "--quiet",
                                                     str(out / "chat-build.yaml")])
    step(f"9/9 train launch (objective sft): {epochs:g} epochs, packed best-fit decreasing with document masking, "
         f"--init from {pretrained.name}", [str(BIN / "train"), "launch", "configs/demo-sft.yaml", "--nproc", "2",
                                            "--init", str(pretrained), "--set", f"data.dataset={chat}",
                                            "--set", f"run_dir={sft}", "--set", f"epochs={epochs}"])
    step("train generate --chat: ask the fine-tuned model (greedy)",
         [str(BIN / "train"), "generate", str(sft), "--chat", "What does `json.dumps` do?", "--max-new-tokens", "48"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--steps", type=int, default=450, help="total training steps (stops at 2/3, then resumes)")
    ap.add_argument("--sft-epochs", type=float, default=2.0, help="epochs of the SFT stage")
    args = ap.parse_args()
    out = REPO / args.out
    if out.exists():
        shutil.rmtree(out)
    data, run, hf, bench = out / "data", out / "run", out / "hf", out / "storage"
    first = args.steps * 2 // 3
    sets = ["--set", f"data.dataset={data}", "--set", f"run_dir={run}", "--set", f"steps={args.steps}"]
    t0 = time.time()
    step("1/9 datapipe build: embedded corpus → filtered, deduplicated, tokenized shards (2 sources, 2 phases, "
         "5 % held out for validation)",
         [str(BIN / "datapipe"), "build", "--set", f"output={data}", "--set", "validation.fraction=0.05",
          "--workers", "2"])
    step("storage verify: every shard's sha256, frames and counts", [str(BIN / "storage"), "verify", str(data)])
    step(f"2/9 train launch: tiny Llama, TP=2 on 2 CPU processes, steps 0 → {first}, async checkpoints, "
         "validation loss + benchmarks every 150 steps",
         [str(BIN / "train"), "launch", "configs/demo.yaml", "--nproc", "2", *sets, "--set", f"stop_at={first}"])
    step(f"3/9 train launch again: auto-resumes from the newest checkpoint, steps {first} → {args.steps}",
         [str(BIN / "train"), "launch", "configs/demo.yaml", "--nproc", "2", *sets])
    step("train plot: loss, grad norm, LR, tokens/s (metrics.png); validation loss and benchmarks (eval.png)",
         [str(BIN / "train"), "plot", str(run)])
    step("4/9 train eval --all: every checkpoint, validation loss and the three benchmarks (TP=1 here: "
         "resharded on load)", [str(BIN / "train"), "eval", str(run), "--all"])
    ckpt = newest_checkpoint(run / "checkpoints")
    step("train ckpt list", [str(BIN / "train"), "ckpt", "list", str(run / "checkpoints")])
    step(f"5/9 train ckpt export: {ckpt.name} → Hugging Face Llama folder",
         [str(BIN / "train"), "ckpt", "export", str(ckpt), str(hf)])
    print("\n=== 6/9 transformers: greedy generation from the export", flush=True)
    for prompt in ("The ", "def "):
        print(f"  {prompt!r} → {generate(hf, prompt)!r}", flush=True)
    step("7/9 storage bench --quick on the run directory",
         [str(BIN / "storage"), "bench", "--quick", str(run), "--out", str(bench)])
    step("train eval --table: which checkpoint is best (a tiny model stays near chance: 0.25 for 4 choices, "
         "0.5 for 2; the validation loss shows the learning)", [str(BIN / "train"), "eval", "--table", str(run)])
    sft_stage(out, data, ckpt, args.sft_epochs)
    print(f"\nDone in {time.time() - t0:.0f} s. Outputs:")
    print(f"  dataset + build report   {data}  (manifest.json; `datapipe report {data}`)")
    print(f"  training run             {run}  (metrics.jsonl, TensorBoard events, config.yaml)")
    print(f"  loss plot, eval plot     {run / 'metrics.png'}, {run / 'eval.png'}")
    print(f"  evaluation results       {run / 'eval'}  (`train eval --table {run}`)")
    print(f"  checkpoints              {run / 'checkpoints'}")
    print(f"  Hugging Face export      {hf}")
    print(f"  storage table + plots    {bench}  (bench.json, *.png)")
    print(f"  chat dataset, SFT run    {out / 'chat'}, {out / 'sft'}  (`train generate {out / 'sft'} --chat ...`)")


if __name__ == "__main__":
    main()
