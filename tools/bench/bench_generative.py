"""Generative evaluation against lm-evaluation-harness's HF backend, in one run: parity and speed.

The model is the demo's SFT checkpoint (`make demo` → demo-out/sft), exported to a Hugging Face folder.
- Parity: `gsm8k_cot` on N items (train eval's path: train.eval.generative + the engine) and lm-eval 0.4.13
  (simple_evaluate, HF backend, a local task YAML including its gsm8k-cot.yaml over the same docs) with the
  same generation settings: generations, extracted answers (strict-match, flexible-extract) and per-item
  exact_match compared item by item, against lm-eval at batch size 1 (its batched output depends on the
  batch, see the report) and at the first --lm-eval-batch. `ifeval` likewise on every one of the 541 prompts (chat template on,
  max_gen_toks lowered with --ifeval-tokens to keep the run short): generations and per-instruction
  results compared.
- Speed: items/s of the whole call on the first --speed-items gsm8k_cot items (model load, prompts,
  generation, scoring) for ours and for lm-eval at its best batch size here (each batch size in
  --lm-eval-batch tried once, the fastest timed), alternating, median of --rounds.
- Engine backends: padded batches vs transformers' continuous batching on CPU, same greedy work.
- Before/after (`--parts before --before REV`): our whole call on the first --speed-items items of each
  --speed-tasks task, REV from a git worktree against this tree, each side a fresh process per round
  (one warm-up call, then --before-calls timed calls), alternating, median of all calls.
- Speculative decoding: the SFT model as target and a draft the script builds from it (its first
  --draft-layers layers, no further training), `train generate --draft`'s path on --spec-prompts chat
  prompts: acceptance rate and speed-up over plain greedy (median per prompt), output identity checked.

    python tools/bench/bench_generative.py [--checkpoint demo-out/sft] [--items 100] [--rounds 3]
        [--append docs/benchmarks-history.md]
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


def ours(folder: str, spec: str, limit: int | None, max_new_tokens: int | None, batch: int,
         lookup: int | None = None) -> tuple[dict, float]:
    from train.eval.config import GenerationEvalConfig
    from train.eval.hf import generate_hf

    cfg = GenerationEvalConfig(max_new_tokens=max_new_tokens, batch_size=batch)
    if lookup is not None:
        cfg.prompt_lookup = lookup
    t0 = time.perf_counter()
    res = generate_hf(folder, [spec], limit, cfg)
    return next(iter(res.values())), time.perf_counter() - t0


def lmeval(folder: str, yaml_path: str, docs: str, work: str, batch: int, chat: bool, max_gen_toks: int | None):
    from train.eval.lmeval import run_lmeval_generative

    r = run_lmeval_generative(folder, yaml_path, docs, work, batch_size=batch, apply_chat_template=chat,
                              max_gen_toks=max_gen_toks)
    return r, r["seconds"]


def compare(mine: dict, ref: dict) -> dict:
    items = mine["items"]
    same_gen = sum(a["generation"] == b for a, b in zip(items, ref["generations"], strict=True))
    same_scores = sum({k: v for k, v in a.items() if k in want} == want
                      for a, want in zip(items, ref["per_item"], strict=True))
    same_answers = sum({k.split(",", 1)[1]: v for k, v in a.items() if k.startswith("filtered,")}
                       == {k: v for k, v in f.items() if k != "none"} for a, f in zip(items, ref["filtered"], strict=True))
    return {"items": len(items), "same_generations": same_gen, "same_answers": same_answers,
            "same_per_item_scores": same_scores}


def speculative(folder: str, layers: int, n_prompts: int, max_new: int) -> dict:
    import copy

    import torch

    from train.generation.chat import generate
    from train.generation.load import Loaded, load

    target = load(folder)
    small = copy.deepcopy(target.model)
    small.model.layers = small.model.layers[:layers]
    small.config.num_hidden_layers = layers
    draft = Loaded(small.eval(), target.tokenizer, target.chat_template, target.eos_ids)
    questions = ["What does `json.dumps` do?", "What does `os.path.join` do?", "What is a `dict`?",
                 "What does `str.split` do?", "What does `itertools.chain` do?", "What does `zip` do?",
                 "What does `sorted` return?", "What does `re.compile` do?"][:n_prompts]
    rows = []
    with torch.no_grad():
        for q in questions:
            generate(folder, q, loaded=target, max_new_tokens=max_new)  # warm-up
            t0 = time.perf_counter()
            plain = generate(folder, q, loaded=target, max_new_tokens=max_new)
            t_plain = time.perf_counter() - t0
            stats = []
            spec = generate(folder, q, loaded=target, draft=draft, stats=stats, max_new_tokens=max_new)
            s = stats[0]
            rows.append({"same": spec.new_ids == plain.new_ids, "acceptance": s.acceptance,
                         "speedup": t_plain / s.seconds, "tokens": s.new_tokens})
    return {"prompts": len(rows), "identical": sum(r["same"] for r in rows),
            "acceptance": statistics.median(r["acceptance"] for r in rows),
            "speedup": statistics.median(r["speedup"] for r in rows),
            "target_layers": target.model.config.num_hidden_layers, "draft_layers": layers}


def backends(folder: str, prompts: int, max_new: int, batch: int) -> dict:
    """Seconds of the engine's CPU backends on the same greedy generations (gsm8k_cot prompts)."""
    from train.eval.generative import GenerativeTask
    from train.generation.engine import Engine
    from train.generation.load import load

    model, tok, template, eos = load(folder)
    task = GenerativeTask("gsm8k_cot", prompts, tok, max_length=model.config.max_position_embeddings,
                          chat_template=template, max_new_tokens=max_new)
    params = task.params()
    params.stop = ()  # the same work on both sides: max_new tokens each
    out = {}
    for backend in ("padded", "continuous", "padded", "continuous"):
        eng = Engine(model, tok, eos, backend=backend, max_batch_size=batch)
        t0 = time.perf_counter()
        eng.generate(task.prompts, params)
        out.setdefault(backend, []).append(time.perf_counter() - t0)
    return {k: min(v) for k, v in out.items()}


PARTS = ("parity", "speed", "ifeval", "spec", "backends", "before")
SPEED = {"gsm8k_cot": ("gsm8k/gsm8k-cot.yaml", False), "gsm8k_cot_chat": ("gsm8k/gsm8k-cot-zeroshot.yaml", True),
         "ifeval": ("ifeval/ifeval.yaml", True)}


def speed(folder: str, work: str, task: str, args) -> dict:
    """Items/s of ours and of lm-eval (its best batch size) on the first --speed-items docs of `task`."""
    from train.eval.generative import read_docs

    yaml_path, chat = SPEED[task]
    _, docs, _ = read_docs(task, args.speed_items)
    path = os.path.join(work, f"speed-{task}.jsonl")
    Path(path).write_text("".join(json.dumps(d) + "\n" for d in docs))
    new = args.ifeval_tokens if task == "ifeval" else None
    tries = {}
    for b in (int(x) for x in args.lm_eval_batch.split(",")):
        _, tries[b] = lmeval(folder, yaml_path, path, os.path.join(work, f"{task}-try{b}"), b, chat, new)
        print(f"{task}: lm-eval batch {b}: {tries[b]:.1f} s", flush=True)
    best = min(tries, key=tries.get)
    t_ours, t_ref, t_plain = [], [], []
    for r in range(args.rounds):
        for side in (("ours", "lm-eval", "plain") if r % 2 == 0 else ("plain", "lm-eval", "ours")):
            if side == "ours":
                mine, dt = ours(folder, f"{task}={path}", None, new, args.batch)
                t_ours.append(dt)
            elif side == "plain":
                plain, dt = ours(folder, f"{task}={path}", None, new, args.batch, lookup=0)
                t_plain.append(dt)
                if [it["generation"] for it in plain["items"]] != [it["generation"] for it in mine["items"]]:
                    sys.exit(f"{task}: generations with and without prompt lookup differ")
            else:
                _, dt = lmeval(folder, yaml_path, path, os.path.join(work, f"{task}-r{r}"), best, chat, new)
                t_ref.append(dt)
            print(f"{task} round {r} {side}: {dt:.1f} s", flush=True)
    n, look = len(docs), mine.get("prompt_lookup", {"forwards": 0, "proposed": 0, "accepted": 0})
    return {"task": task, "items": n, "max_new": mine["max_new_tokens"], "best": best,
            "ours": n / statistics.median(t_ours), "ref": n / statistics.median(t_ref),
            "plain": n / statistics.median(t_plain), "lookup": look,
            "ended": sum(it["finish_reason"] == "stop" for it in mine["items"])}


_TIMED_CALLS = """
import json, sys, time
from train.eval.config import GenerationEvalConfig
from train.eval.hf import generate_hf
folder, spec, new, n = sys.argv[1], sys.argv[2], int(sys.argv[3]) or None, int(sys.argv[4])
cfg = GenerationEvalConfig(batch_size=int(sys.argv[5]), max_new_tokens=new)
generate_hf(folder, [spec], 4, cfg)
times = []
for _ in range(n):
    t = time.perf_counter()
    generate_hf(folder, [spec], None, cfg)
    times.append(time.perf_counter() - t)
import train
print("TIMES", json.dumps(times), train.__file__)
"""


def before_after(folder: str, work: str, args) -> list[dict]:
    """Seconds per whole call of ours at --before (a worktree) and in this tree, alternating fresh processes."""
    import subprocess

    from train.eval.generative import read_docs

    repo = Path(__file__).resolve().parents[2]
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=repo, capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = Path(work) / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=repo, check=True, capture_output=True)
    rows = []
    try:
        for task in args.speed_tasks.split(","):
            _, docs, _ = read_docs(task, args.speed_items)
            path = os.path.join(work, f"before-{task}.jsonl")
            Path(path).write_text("".join(json.dumps(d) + "\n" for d in docs))
            new = args.ifeval_tokens if task == "ifeval" else 0
            times: dict[str, list[float]] = {"before": [], "after": []}
            for r in range(args.rounds):
                for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    src = tree if side == "before" else repo
                    res = subprocess.run([sys.executable, "-c", _TIMED_CALLS, folder, f"{task}={path}", str(new),
                                          str(args.before_calls), str(args.batch)], capture_output=True, text=True,
                                         cwd=src, env={**os.environ, "PYTHONPATH": str(src)})
                    line = [x for x in res.stdout.splitlines() if x.startswith("TIMES ")]
                    if res.returncode != 0 or not line:
                        sys.exit(f"{side} ({src}) failed:\n{res.stderr[-3000:]}")
                    got, used = line[0][6:].rsplit(" ", 1)
                    if not used.startswith(str(src)):  # the code timed must be the side's tree
                        sys.exit(f"{side}: imported {used}, not from {src}")
                    times[side] += json.loads(got)
                    print(f"{task} round {r} {side}: {times[side][-args.before_calls:]}", flush=True)
            rows.append({"task": task, "rev": rev, "before": statistics.median(times["before"]),
                         "after": statistics.median(times["after"]), "calls": len(times["after"])})
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="demo-out/sft", help="a checkpoint or run dir (its newest), or HF folder")
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed-items", type=int, default=32, help="items of each task's timed rounds")
    ap.add_argument("--speed-tasks", default="gsm8k_cot,gsm8k_cot_chat,ifeval", help="tasks timed against lm-eval")
    ap.add_argument("--batch", type=int, default=32, help="our engine's batch size")
    ap.add_argument("--lm-eval-batch", default="8,32,64", help="lm-eval batch sizes to try (its best is timed; "
                    "the first also runs the parity checks, gsm8k_cot besides batch 1)")
    ap.add_argument("--ifeval-tokens", type=int, default=64, help="max_gen_toks of the IFEval parity run")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--spec-prompts", type=int, default=8)
    ap.add_argument("--before", default=None, help="git revision for --parts before (our call there vs here)")
    ap.add_argument("--before-calls", type=int, default=3, help="timed calls per process of --parts before")
    ap.add_argument("--parts", default=",".join(p for p in PARTS if p != "before"), help=f"which of {', '.join(PARTS)} to run")
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        sys.exit(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; known: {', '.join(PARTS)}")

    from train.eval.generative import read_docs
    from train.generation.load import is_hf_folder

    work = tempfile.mkdtemp(prefix="bench-gen-")
    folder = args.checkpoint
    if not is_hf_folder(folder):
        from train.checkpoint.export_hf import export
        from train.checkpoint.layout import find_checkpoints

        folder = os.path.join(work, "hf")
        export(find_checkpoints(args.checkpoint, every=False)[0], folder)
    _, docs, _ = read_docs("gsm8k_cot", args.items)
    gdocs = os.path.join(work, "gsm8k.jsonl")
    Path(gdocs).write_text("".join(json.dumps(d) + "\n" for d in docs))
    first = int(args.lm_eval_batch.split(",")[0])
    out = []
    cmd = "python tools/bench/bench_generative.py " + " ".join(sys.argv[1:])
    out.append(f"""
## Generative evaluation vs lm-evaluation-harness ({datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores)

`{cmd}`: the demo's SFT model exported to a HF folder; lm-eval {_version("lm_eval")} HF backend, offline, local task
YAMLs including its own gsm8k-cot.yaml / ifeval.yaml over the same docs; greedy, lm-eval's stop sequences and
max_gen_toks (gsm8k_cot 256; ifeval lowered to {args.ifeval_tokens} for both sides).
""")
    if "parity" in parts:
        mine, t_mine = ours(folder, "gsm8k_cot", args.items, None, args.batch)
        ref, t_ref0 = lmeval(folder, "gsm8k/gsm8k-cot.yaml", gdocs, os.path.join(work, "parity"), 1, False, None)
        parity = compare(mine, ref)
        batched, _ = lmeval(folder, "gsm8k/gsm8k-cot.yaml", gdocs, os.path.join(work, "parity-b"), first, False, None)
        at_first = compare(mine, batched)
        print(f"gsm8k_cot parity {parity} (lm-eval batch {first}: {at_first}): ours {t_mine:.1f} s, "
              f"lm-eval (batch 1) {t_ref0:.1f} s", flush=True)
        out.append(f"""
gsm8k_cot (8-shot) on {parity['items']} items against lm-eval at batch size 1: same generations
{parity['same_generations']}, same extracted answers (both filters) {parity['same_answers']}, same per-item exact_match
{parity['same_per_item_scores']} (ours {t_mine:.0f} s at batch {args.batch}, lm-eval {t_ref0:.0f} s). Against lm-eval at batch {first}:
{at_first['same_generations']} generations, {at_first['same_answers']} answers, {at_first['same_per_item_scores']} exact_match the same. lm-eval's batched output
depends on the batch: its stop check ends the whole batch only, and it decodes without special tokens, so a row
that writes a special stop token (`<|im_end|>`, in gsm8k-cot.yaml's `until`) goes on writing text, kept, until
its batchmates end; at batch size 1 the row ends there, as ours does in any batch.
""")
    if "ifeval" in parts:
        mine, _ = ours(folder, "ifeval", None, args.ifeval_tokens, args.batch)
        _, idocs, _ = read_docs("ifeval")
        ipath = os.path.join(work, "ifeval.jsonl")
        Path(ipath).write_text("".join(json.dumps(d) + "\n" for d in idocs))
        ref, _ = lmeval(folder, "ifeval/ifeval.yaml", ipath, os.path.join(work, "ifeval"), first, True,
                        args.ifeval_tokens)
        ifeval = compare(mine, ref)
        ifeval["same_instruction_results"] = sum(
            a["inst_level_strict_acc"] == b["inst_level_strict_acc"] and a["inst_level_loose_acc"] == b["inst_level_loose_acc"]
            for a, b in zip(mine["items"], ref["per_item"], strict=True))
        ifeval["instructions"] = sum(len(b["inst_level_strict_acc"]) for b in ref["per_item"])
        differ = [d["key"] for d, a, b in zip(idocs, mine["items"], ref["per_item"], strict=True)
                  if (a["inst_level_strict_acc"], a["inst_level_loose_acc"]) !=
                  (b["inst_level_strict_acc"], b["inst_level_loose_acc"])]
        print("ifeval parity", ifeval, "differ", differ, flush=True)
        random_letter = {1122, 1129}  # lm-eval's letter-frequency checker draws a letter for these (train.eval.generative)
        out.append(f"""
ifeval (chat template) on all {ifeval['items']} prompts: same generations {ifeval['same_generations']}, same
per-instruction results (strict and loose) on {ifeval['same_instruction_results']} prompts ({ifeval['instructions']}
instructions), same prompt-level scores on {ifeval['same_per_item_scores']}. Prompts that differ: {differ or 'none'}
({'all of them ' if set(differ) <= random_letter else 'not only '}prompts whose letter-frequency instruction names a
non-letter, for which lm-eval's checker draws a random letter from Python's `random` state: these two score
by chance in lm-eval; ours seeds `random` per doc).
""")
    if "speed" in parts:
        rows = []
        for task in args.speed_tasks.split(","):
            r = speed(folder, work, task, args)
            rows.append(r)
            print("speed", r, flush=True)
        out.append(f"""
Speed on the first {args.speed_items} items of each task (whole call: model load, prompts, generation,
scoring; median of {args.rounds} alternating rounds; lm-eval at its best batch size here, each of
{args.lm_eval_batch} tried once; ours at engine batch {args.batch}, with the default prompt-lookup speculative
decoding and without it (`eval.generation.prompt_lookup=0`: the same generations, checked every round):

| task | max new tokens | ours items/s | lm-eval items/s (batch) | ours / lm-eval | ours without prompt lookup | guesses kept (verifying forwards) | rows ending before the budget |
|---|---|---|---|---|---|---|---|
""" + "".join(f"| {r['task']} | {r['max_new']} | {r['ours']:.2f} | {r['ref']:.2f} ({r['best']}) | **{r['ours'] / r['ref']:.2f}x** "
              f"| {r['plain']:.2f} ({r['plain'] / r['ref']:.2f}x) "
              f"| {r['lookup']['accepted']}/{r['lookup']['proposed']} ({r['lookup']['forwards']}) "
              f"| {r['ended']}/{r['items']} |\n" for r in rows))
    if "spec" in parts:
        spec = speculative(folder, args.draft_layers, args.spec_prompts, 48)
        print("speculative", spec, flush=True)
        out.append(f"""
Speculative decoding (`train generate --draft`), target the SFT model ({spec['target_layers']} layers), draft its
first {spec['draft_layers']} layer(s) (built by the script, not trained further), {spec['prompts']} chat prompts, 48
new tokens: acceptance {spec['acceptance']:.1%}, speed-up {spec['speedup']:.2f}x (median per prompt), output
identical to plain greedy on {spec['identical']}/{spec['prompts']} prompts. On 2 CPU cores a 4-layer, 128-wide target
costs about as much per forward pass as its draft (fixed per-call overhead dominates), so assisted generation
cannot win here; it pays when the target is much larger than the draft.
""")
    if "backends" in parts:
        eng = backends(folder, 32, 48, args.batch)
        print("engine backends", eng, flush=True)
        out.append(f"""
Engine backends on CPU (32 gsm8k_cot prompts, 48 new tokens each, no stop strings, batch {args.batch}, best of 2):
padded `generate` with a static cache {eng['padded']:.1f} s, transformers continuous batching {eng['continuous']:.1f} s
({eng['continuous'] / eng['padded']:.1f}x).
""")
    if "before" in parts:
        if not args.before:
            sys.exit("--parts before needs --before REV")
        rows = before_after(folder, work, args)
        print("before/after", rows, flush=True)
        out.append(f"""
Our whole call before ({rows[0]['rev']}, a git worktree) and after (this tree), first {args.speed_items} items,
{args.rounds} alternating rounds of a fresh process per side ({args.before_calls} timed calls each after a warm-up),
median of all calls:

| task | before s | after s | before / after |
|---|---|---|---|
""" + "".join(f"| {r['task']} | {r['before']:.2f} | {r['after']:.2f} | **{r['before'] / r['after']:.2f}x** |\n"
              for r in rows))
    if args.append:
        with open(args.append, "a") as f:
            f.write("".join(out))


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg.replace("_", "-"))


if __name__ == "__main__":
    main()
