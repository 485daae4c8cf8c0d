"""Benchmark SFT: `train launch` with objective sft (packed best-fit decreasing, document masking, loss on
assistant tokens) against TRL's `SFTTrainer` (packing, strategy bfd, which is padding-free, and
assistant_only_loss) on the same Llama shape, the same tokenized conversations and this machine.

The conversations are made from the standard library's docstrings (datapipe.demo.chat_docs) and built
once with `datapipe build` (chat source, ChatML, loss on assistant turns). TRL gets exactly those token
ids and masks (read back from the shards) as a pre-tokenized dataset. Both sides: float32, one process,
--rows packed rows of --seq tokens per optimizer step, one forward per step, AdamW. Throughput is
non-padding tokens per second of the steps after the first --skip (model build and start-up excluded),
median over --runs alternating runs of each side; both packing efficiencies are reported (TRL's
padding-free batches compute no padding, its rows are filled to the same best-fit bound).

    python tools/bench/bench_sft.py [--runs 3] [--steps 25] [--no-write]
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHAPE = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 688,
         "rope_theta": 10000.0, "norm_eps": 1e-5, "max_position_embeddings": 2048}


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def build(work: Path, seq: int) -> Path:
    import yaml

    from datapipe.demo import chat_docs

    src = work / "chat.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in chat_docs(3000)))
    cfg = {"output": str(work / "ds"), "tokenizer": {"vocab_size": 4096},
           "sources": [{"name": "qa", "paths": [str(src)], "format": "chat", "chat": {"max_tokens": seq}}]}
    (work / "build.yaml").write_text(yaml.safe_dump(cfg))
    _run([sys.executable, "-m", "datapipe.cli", "build", "--quiet", str(work / "build.yaml")])
    return work / "ds"


def ours(work: Path, ds: Path, args) -> dict:
    import yaml

    run = work / f"ours-{time.time_ns()}"
    cfg = {"run_dir": str(run), "steps": args.steps, "seed": 1, "objective": "sft",
           "model": {"preset": "tiny", **SHAPE}, "data": {"dataset": str(ds), "seq_len": args.seq, "seed": 1},
           "parallel": {"global_batch_size": args.rows, "micro_batch_size": args.rows},
           "optim": {"lr": 1e-5, "min_lr": 1e-6, "warmup_steps": 0, "schedule": "constant"},
           "monitor": {"log_every": 1, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
           "checkpoint": {"full_every": 0, "incremental_every": 0}}
    (work / "ours.yaml").write_text(yaml.safe_dump(cfg))
    _run([sys.executable, "-m", "train.cli", "launch", str(work / "ours.yaml"), "--nproc", "1"])
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r][args.skip:]
    tokens = sum(r["nonpad_tokens_per_s"] * r["step_time_s"] for r in recs)
    return {"tokens_per_s": tokens / sum(r["step_time_s"] for r in recs),
            "nonpad_share": statistics.fmean(r["packing_efficiency"] for r in recs)}


def trl_worker(ds: str, args) -> dict:
    """In a fresh process: SFTTrainer on the dataset's own token ids and masks."""
    import torch
    from datasets import Dataset as HFDataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from storage.dataset import Dataset

    d = Dataset.open(ds)
    ids, masks = [], []
    for readers in d.readers.values():
        for r in readers:
            for k in range(len(r.index)):
                b = r.read_block(k)
                for i in range(len(b.doc_ids)):
                    a, z = b.offsets[i], b.offsets[i + 1]
                    ids.append(b.tokens[a:z].astype("int64").tolist())
                    masks.append(b.mask[a:z].astype("int64").tolist())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(ds) / d.manifest.tokenizer.file),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    torch.manual_seed(1)
    s = SHAPE
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=d.manifest.tokenizer.vocab_size, hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
        intermediate_size=s["ffn_hidden_size"], rope_theta=s["rope_theta"], rms_norm_eps=s["norm_eps"],
        max_position_embeddings=s["max_position_embeddings"], tie_word_embeddings=True,
        attn_implementation="sdpa"))
    times, counts = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    cfg = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.rows,
                    learning_rate=1e-5, lr_scheduler_type="constant", packing=True, packing_strategy="bfd",
                    max_length=args.seq, use_cpu=True, report_to=[], save_strategy="no",
                    logging_steps=10**6, dataloader_num_workers=0, seed=1, bf16=False)
    train = HFDataset.from_dict({"input_ids": ids, "assistant_masks": masks})
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok, callbacks=[Clock()])
    collate = trainer.data_collator

    def counting(examples):
        counts.append(sum(len(e["input_ids"]) for e in examples))
        return collate(examples)

    trainer.data_collator = counting
    packed = trainer.train_dataset
    row_tokens = statistics.fmean(len(x) for x in packed["input_ids"])
    trainer.train()
    n = min(len(times), len(counts))
    t, c = times[args.skip:n], counts[args.skip:n]
    return {"tokens_per_s": sum(c) / sum(t), "nonpad_share": 1.0, "row_fill": row_tokens / args.seq,
            "rows": len(packed), "trl": __import__("trl").__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the timing")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=8, help="packed rows per optimizer step")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        print("RESULT " + json.dumps(trl_worker(args.trl_worker, args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ds = build(work, args.seq)
        mine, theirs = [], []
        for i in range(args.runs):
            mine.append(ours(work, ds, args))
            out = _run([sys.executable, __file__, "--trl-worker", str(ds), "--steps", str(args.steps),
                        "--skip", str(args.skip), "--seq", str(args.seq), "--rows", str(args.rows)])
            theirs.append(json.loads(out.split("RESULT ", 1)[1]))
            print(f"run {i + 1}: ours {mine[-1]['tokens_per_s']:,.0f} tok/s, TRL {theirs[-1]['tokens_per_s']:,.0f} "
                  "tok/s", flush=True)
    a = statistics.median(m["tokens_per_s"] for m in mine)
    b = statistics.median(t["tokens_per_s"] for t in theirs)
    eff = statistics.median(m["nonpad_share"] for m in mine)
    fill = theirs[0]["row_fill"]
    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items() if k in ("hidden_size", "num_layers", "num_heads",
                                                                    "num_kv_heads", "ffn_hidden_size"))
    text = (f"\n## SFT: packed conversations, ours vs TRL SFTTrainer ({datetime.date.today()})\n\n"
            f"`python tools/bench/bench_sft.py --runs {args.runs} --steps {args.steps}` on {platform.node()} "
            f"({os.cpu_count()} CPUs, {platform.machine()}); TRL {theirs[0]['trl']}. Llama shape: {shape}; "
            f"3,000 stdlib-docstring conversations (ChatML, loss on assistant turns), {args.rows} packed rows of "
            f"{args.seq} tokens per step, float32, one process each, median of {args.runs} alternating runs, "
            f"steps {args.skip + 1}-{args.steps} timed.\n\n"
            "| | non-padding tokens/s | non-padding share of computed tokens | rows filled to |\n|---|---|---|---|\n"
            f"| smoltrain `train launch` (objective sft, document masking) | {a:,.0f} | {eff:.1%} | {eff:.1%} |\n"
            f"| TRL SFTTrainer (packing bfd, padding-free, assistant_masks → labels) | {b:,.0f} | 100% (padding-free) | "
            f"{fill:.1%} |\n\n**Ratio: {a / b:.2f}x** TRL's non-padding tokens/s (goal >= 1.2x); our packing "
            f"efficiency {eff:.1%} (goal >= 95 %).\n")
    print(text)
    if not args.no_write:
        with open(REPO / "docs" / "benchmarks-history.md", "a") as f:
            f.write(text)
        print("appended to docs/benchmarks-history.md")


if __name__ == "__main__":
    main()
