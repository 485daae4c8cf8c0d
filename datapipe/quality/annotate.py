"""`datapipe annotate`: score a deterministic sample of a source's documents with an LLM (the FineWeb-Edu
way) through the project's one generation engine, into a resumable JSONL of id, text, score and reply.

- Documents: JSONL/Parquet/Arrow/text paths or globs read by datapipe's own reader (`SourceReader`, as
  `datapipe tokenizer train` reads them); `sample` of them chosen by the sha256 of (seed, id): the same
  documents every run, in input order; each cropped to `max_chars` characters (FineWeb-Edu crops too).
- Prompt: a template with `{text}` (replaced literally, other braces kept): the built-in `fineweb-edu` or
  a file. With `chat` (None: when the model has a chat template) the prompt is the user message of the
  model's chat template (train.generation.chat.chat_prompt). The score is the regex's one group at its
  last match in the reply, a number when it reads as one (else its text: a label); a reply without a
  match is kept with `score: null` and counted as unparseable.
- Model: train.generation.load (a checkpoint of any layout or a Hugging Face folder), generation by
  train.generation.engine (`auto`: vLLM on a GPU, else the padded transformers backend); greedy by default.
- Output: FILE (one record per document, written a batch at a time, each batch flushed and fsynced) and
  FILE.meta.json: the model's fingerprint (a checkpoint: train.objectives.refs.checkpoint_hash, the
  sha256 of its manifest that lists every file's checksum; a HF folder: sha256 over its weight, config and
  tokenizer files), the template's sha256, the sampling settings and the counts. A rerun with the same
  arguments drops a partly written last line, skips the documents already there and continues: the
  result equals an uninterrupted run byte for byte; a rerun with another model, prompt or setting into
  the same FILE is refused, naming what differs.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import re
from dataclasses import dataclass

import click

from storage.cliutil import die
from storage.fs import file_sha256

# The FineWeb-Edu annotation prompt (Llama-3-70B-Instruct's, FineWeb paper, appendix F.1), as published at
# https://huggingface.co/HuggingFaceFW/fineweb-edu-classifier/blob/main/utils/prompt.txt; copied from the copy
# that cites it in the inference-hive project (examples/fineweb2_annotations/prepare_dataset.py), its
# placeholder named {text}. Spaces at line ends and the two spaces before <total points> are the original's.
FINEWEB_EDU = (
    "Below is an extract from a web page. Evaluate whether the page has a high educational value and could be "
    "useful in an educational setting for teaching from primary school to grade school levels using the additive "
    "5-point scoring system described below. Points are accumulated based on the satisfaction of each criterion:\n"
    "\n"
    "- Add 1 point if the extract provides some basic information relevant to educational topics, even if it "
    "includes some irrelevant or non-academic content like advertisements and promotional material.\n"
    "- Add another point if the extract addresses certain elements pertinent to education but does not align "
    "closely with educational standards. It might mix educational content with non-educational material, offering "
    "a superficial overview of potentially useful topics, or presenting information in a disorganized manner and "
    "incoherent writing style.\n"
    "- Award a third point if the extract is appropriate for educational use and introduces key concepts relevant "
    "to school curricula. It is coherent though it may not be comprehensive or could include some extraneous "
    "information. It may resemble an introductory section of a textbook or a basic tutorial that is suitable for "
    "learning but has notable limitations like treating concepts that are too complex for grade school students. \n"
    "- Grant a fourth point if the extract highly relevant and beneficial for educational purposes for a level not "
    "higher than grade school, exhibiting a clear and consistent writing style. It could be similar to a chapter "
    "from a textbook or a tutorial, offering substantial educational content, including exercises and solutions, "
    "with minimal irrelevant information, and the concepts aren't too advanced for grade school students. The "
    "content is coherent, focused, and valuable for structured learning.\n"
    "- Bestow a fifth point if the extract is outstanding in its educational value, perfectly suited for teaching "
    "either at primary school or grade school. It follows detailed reasoning, the writing style is easy to follow "
    "and offers profound and thorough insights into the subject matter, devoid of any non-educational or complex "
    "content.\n"
    "\n"
    "The extract:\n"
    "{text}.\n"
    "\n"
    "After examining the extract: \n"
    "- Briefly justify your total score, up to 100 words.\n"
    "- Conclude with the score using the format: \"Educational score:  <total points>\"\n"
)
SCORE_REGEX = r"Educational score:\s*([0-9]+(?:\.[0-9]+)?)"
PROMPTS = {"fineweb-edu": FINEWEB_EDU}
# a HF folder's files that decide what it generates (train.generation.load reads safetensors only)
MODEL_FILES = re.compile(r".*\.safetensors|.*\.json|.*\.jinja|tokenizer\.model|vocab\..*|merges\.txt")
NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# settings whose change makes the output another one: a rerun into the same FILE must have them all equal
IDENTITY = ("model_fingerprint", "prompt_sha256", "score_regex", "chat", "max_chars", "sampling", "sample")


class AnnotateError(ValueError):
    """Bad input or an output written with other settings; the one-line message names the option and file."""


@dataclass
class Settings:
    model: str
    output: str
    inputs: list[str]
    prompt: str = "fineweb-edu"           # a built-in's name or a template file
    score_regex: str = SCORE_REGEX
    sample: int | None = None             # None: every document
    seed: int = 0
    batch_size: int = 64
    max_new_tokens: int = 256
    max_chars: int = 5000
    chat: bool | None = None              # None: the model's chat template when it has one
    temperature: float = 0.0
    top_p: float = 1.0
    text_field: str = "text"
    id_field: str | None = "id"
    backend: str = "auto"


def read_template(prompt: str) -> str:
    if prompt in PROMPTS:
        return PROMPTS[prompt]
    if not os.path.isfile(prompt):
        raise AnnotateError(f"--prompt {prompt}: neither a built-in ({', '.join(PROMPTS)}) nor a file")
    with open(prompt, encoding="utf-8") as f:
        template = f.read()
    if "{text}" not in template:
        raise AnnotateError(f"--prompt {prompt}: the template has no {{text}} (where the document goes)")
    return template


def compile_regex(regex: str) -> re.Pattern:
    try:
        pat = re.compile(regex)
    except re.error as e:
        raise AnnotateError(f"--score-regex {regex!r}: not a regular expression ({e})") from None
    if pat.groups != 1:
        raise AnnotateError(f"--score-regex {regex!r}: needs exactly one group (the score), has {pat.groups}")
    return pat


def parse_score(reply: str, pat: re.Pattern) -> int | float | str | None:
    """The group of the regex's last match in `reply`: a number when it reads as one, else its text (a label,
    e.g. `Verdict: (select|skip)`); None when nothing matches or the group is empty."""
    last = None
    for m in pat.finditer(reply):
        last = m
    value = (last.group(1) or "").strip() if last else ""
    if re.fullmatch(r"[+-]?[0-9]+", value):
        return int(value)
    if NUMBER.fullmatch(value) and math.isfinite(float(value)):
        return float(value)
    return value or None


def sample_documents(s: Settings) -> tuple[list[tuple[str, str]], int, int]:
    """(the sample's (id, cropped text) in input order, documents read, records skipped: unreadable or empty).
    A repeated id gets `#2`, `#3`, ... in read order."""
    from datapipe.config import SourceConfig
    from datapipe.inputs import expand_sources
    from datapipe.sources import SourceReader

    src = SourceConfig("doc", list(s.inputs), text_field=s.text_field, id_field=s.id_field)
    try:
        files = expand_sources([src])
    except FileNotFoundError as e:
        raise AnnotateError(f"INPUTS: {f'{e.filename}: {e.strerror}' if e.filename else str(e)}") from None
    reader = SourceReader(files, {"doc": src}, rejects=os.devnull, max_chars=10**12)
    heap: list[tuple[bytes, int, str, str]] = []  # (-key as the max-heap of the smallest keys, order, id, text)
    seen: dict[str, int] = {}
    n = skipped = 0
    for f in files:
        for _, text, doc_id, err, *_ in reader._records(f, src):
            if err is not None or not text.strip():
                skipped += 1
                continue
            doc_id = doc_id.removeprefix("doc/")  # the record's id, else FILE:LINE (the reader's `source/` off)
            seen[doc_id] = seen.get(doc_id, 0) + 1
            uid = doc_id if seen[doc_id] == 1 else f"{doc_id}#{seen[doc_id]}"
            key = hashlib.sha256(f"{s.seed}\0{uid}".encode()).digest()
            item = (bytes(255 - b for b in key), n, uid, text[:s.max_chars])
            n += 1
            if s.sample is None or len(heap) < s.sample:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
    return [(uid, text) for _, _, uid, text in sorted(heap, key=lambda t: t[1])], n, skipped


def resolve_model(path: str) -> tuple[str, str]:
    """(the folder load() reads: a HF folder or the newest checkpoint, its fingerprint)."""
    from train.generation.load import is_hf_folder

    if not os.path.exists(path):
        raise AnnotateError(f"--model {path}: no such file or folder")
    if is_hf_folder(path):
        files = sorted(f for f in os.listdir(path)
                       if MODEL_FILES.fullmatch(f) and os.path.isfile(os.path.join(path, f)))
        if not any(f.endswith(".safetensors") for f in files):
            raise AnnotateError(f"--model {path}: a Hugging Face folder without safetensors weights")
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f}\0{file_sha256(os.path.join(path, f))}\n".encode())
        return path, "sha256:" + h.hexdigest()
    from storage.config import ConfigError
    from train.checkpoint.layout import find_checkpoints
    from train.objectives.refs import checkpoint_hash

    try:
        ckpt = find_checkpoints(os.path.abspath(path), every=False)[0]
    except (ConfigError, FileNotFoundError, IndexError) as e:
        raise AnnotateError(f"--model {path}: neither a Hugging Face folder (config.json) nor a checkpoint "
                            f"({e})") from None
    return ckpt, "checkpoint:" + checkpoint_hash(ckpt)


def meta_path(output: str) -> str:
    return output + ".meta.json"


def read_done(output: str) -> tuple[set[str], int, int]:
    """(ids already in `output`, scored, unparseable), after cutting a partly written last line (a killed
    run's) off the file."""
    if not os.path.exists(output):
        return set(), 0, 0
    with open(output, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(output, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    ids, scored, unparseable = set(), 0, 0
    for k, line in enumerate(data[:end].splitlines(), start=1):
        try:
            rec = json.loads(line)
            ids.add(rec["id"])
        except (ValueError, KeyError, TypeError):
            raise AnnotateError(f"--output {output}: line {k} is not an annotation record") from None
        if rec.get("score") is None:
            unparseable += 1
        else:
            scored += 1
    return ids, scored, unparseable


def check_same(output: str, old: dict, new: dict) -> None:
    """Refuse to continue `output` written with other settings, naming the first that differs."""
    for key in IDENTITY:
        if old.get(key) != new[key]:
            what = {"model_fingerprint": "model (fingerprint)", "prompt_sha256": "prompt (template sha256)"}.get(
                key, key)
            raise AnnotateError(f"--output {output}: written with another {what}: {json.dumps(old.get(key))} there, "
                                f"{json.dumps(new[key])} now; use another --output or delete it and "
                                f"{os.path.basename(meta_path(output))}")


def write_meta(output: str, meta: dict) -> None:
    tmp = meta_path(output) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, meta_path(output))


def prepare(s: Settings) -> tuple[dict, list[tuple[str, str]], str, str]:
    """Check the arguments and an existing output: (the meta, the sample, the template, the model folder that
    load() reads); no model loaded."""
    if s.batch_size < 1 or s.max_new_tokens < 1 or s.max_chars < 1 or (s.sample is not None and s.sample < 1):
        raise AnnotateError("--batch-size, --max-new-tokens, --max-chars and --sample must be >= 1")
    if s.temperature < 0 or not 0 < s.top_p <= 1:
        raise AnnotateError("--temperature must be >= 0 and --top-p in (0, 1]")
    template = read_template(s.prompt)
    compile_regex(s.score_regex)
    folder, fingerprint = resolve_model(s.model)
    docs, n_read, skipped = sample_documents(s)
    if not docs:
        raise AnnotateError(f"INPUTS {' '.join(s.inputs)}: no document with a non-empty {s.text_field!r} field")
    ids = hashlib.sha256("\n".join(uid for uid, _ in docs).encode()).hexdigest()
    meta = {"model": s.model, "model_fingerprint": fingerprint, "prompt": s.prompt,
            "prompt_sha256": hashlib.sha256(template.encode()).hexdigest(), "score_regex": s.score_regex,
            "chat": "auto" if s.chat is None else s.chat, "max_chars": s.max_chars,
            "sampling": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                         "seed": s.seed},
            "sample": {"requested": s.sample, "seed": s.seed, "documents": len(docs), "ids_sha256": ids},
            "inputs": list(s.inputs), "text_field": s.text_field, "documents_read": n_read,
            "records_skipped": skipped}
    mp = meta_path(s.output)
    if os.path.exists(mp):
        try:
            with open(mp, encoding="utf-8") as f:
                old = json.load(f)
        except ValueError:
            raise AnnotateError(f"--output {s.output}: {mp} is not JSON; delete both to start again") from None
        check_same(s.output, old, meta)
    elif os.path.exists(s.output) and os.path.getsize(s.output):
        raise AnnotateError(f"--output {s.output}: exists without {os.path.basename(mp)} (not an annotate output)")
    return meta, docs, template, folder


def annotate(s: Settings, progress: bool = True, log=print) -> dict:
    """Annotate (or continue annotating) `s.output`; returns the final meta."""
    meta, docs, template, folder = prepare(s)
    pat = compile_regex(s.score_regex)
    os.makedirs(os.path.dirname(os.path.abspath(s.output)), exist_ok=True)
    done, scored, unparseable = read_done(s.output)

    def counts() -> dict:
        return {"done": len(done), "scored": scored, "unparseable": unparseable,
                "complete": len(done) == len(docs)}

    if done and len(done) == len(docs):  # nothing to generate: the meta of the run that wrote the last batch,
        with open(meta_path(s.output), encoding="utf-8") as f:  # its counts brought up to date (a kill between
            old = json.load(f)  # the batch's write and the meta's leaves them one batch behind)
        if old.get("counts") != counts():
            write_meta(s.output, old := {**old, "counts": counts()})
        return old
    from train.generation.chat import chat_prompt
    from train.generation.engine import Engine, SamplingParams
    from train.generation.load import GenerateError, load

    try:
        loaded = load(folder)
    except (GenerateError, OSError, ValueError) as e:
        raise AnnotateError(f"--model {s.model}: {e}") from None
    chat = loaded.chat_template is not None if s.chat is None else s.chat
    tok = loaded.tokenizer
    stop = chat_prompt(loaded, [{"role": "user", "content": "x"}])[1] if chat else list(loaded.eos_ids)
    try:
        engine = Engine(loaded.model, tok, stop, backend=s.backend, max_batch_size=s.batch_size)
    except ValueError as e:
        raise AnnotateError(f"--backend {s.backend}: {e}") from None
    meta["chat_template_applied"], meta["backend"] = chat, engine.backend
    write_meta(s.output, {**meta, "counts": counts()})
    if done:
        log(f"{s.output}: {len(done):,} of {len(docs):,} documents already annotated; continuing")

    from tqdm import tqdm

    bar = tqdm(total=len(docs), initial=len(done), unit="doc", desc="annotate", disable=not progress)
    with open(s.output, "a", encoding="utf-8") as out:
        for b, start in enumerate(range(0, len(docs), s.batch_size)):
            batch = [(uid, text) for uid, text in docs[start:start + s.batch_size] if uid not in done]
            if not batch:
                continue
            prompts = [template.replace("{text}", text) for _, text in batch]
            if chat:
                prompts = [chat_prompt(loaded, [{"role": "user", "content": p}])[0] for p in prompts]
            ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
            params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                    seed=s.seed * 1_000_003 + b, stop_token_ids=tuple(stop))
            lines = []
            for (uid, text), comps in zip(batch, engine.generate(ids, params), strict=True):
                new = comps[0].token_ids
                reply = tok.decode(new[:-1] if new and new[-1] in stop else new, skip_special_tokens=True)
                score = parse_score(reply, pat)
                scored, unparseable = scored + (score is not None), unparseable + (score is None)
                done.add(uid)
                lines.append(json.dumps({"id": uid, "text": text, "score": score, "reply": reply},
                                        ensure_ascii=False) + "\n")
            out.write("".join(lines))
            out.flush()
            os.fsync(out.fileno())
            write_meta(s.output, {**meta, "counts": counts()})
            bar.update(len(batch))
    bar.close()
    return {**meta, "counts": counts()}


@click.command("annotate")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--model", required=True, metavar="PATH",
              help="A checkpoint (step_… folder, or a run dir: its newest) or a Hugging Face folder.")
@click.option("--output", "-o", required=True, metavar="FILE.jsonl", help="Annotations (FILE.jsonl.meta.json beside).")
@click.option("--prompt", default="fineweb-edu", show_default=True, metavar="fineweb-edu|FILE",
              help="Built-in template (fineweb-edu) or a template file with {text}.")
@click.option("--score-regex", default=SCORE_REGEX, show_default=True, metavar="RE",
              help="One group: the score (its last match in the reply).")
@click.option("--sample", type=int, default=None, help="Documents to annotate (default: all).")
@click.option("--seed", type=int, default=0, show_default=True, help="Picks the sample (and seeds sampling).")
@click.option("--batch-size", type=int, default=64, show_default=True, help="Prompts per generation call.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--max-chars", type=int, default=5000, show_default=True, help="Documents cropped to this.")
@click.option("--chat/--no-chat", default=None, help="Wrap the prompt in the model's chat template "
              "(default: when the model has one).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--text-field", default="text", show_default=True, help="Text field of JSONL/Parquet inputs.")
@click.option("--id-field", default="id", show_default=True, help="Id field (absent: file and line).")
@click.option("--backend", type=click.Choice(["auto", "continuous", "padded", "vllm"]), default="auto",
              show_default=True, help="Generation engine backend (auto: vLLM on a GPU, else padded).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def command(inputs, model, output, quiet, **kw) -> None:
    """Score a deterministic sample of INPUTS (JSONL/Parquet/text paths or globs) with an LLM, the FineWeb-Edu
    way: one JSONL record per document (id, text as the model saw it, score, reply; score null when the
    reply has none). FILE.jsonl.meta.json: the model's fingerprint, the prompt's sha256, the settings and
    counts. Rerun the same command after an interruption: it continues where it stopped; a rerun with
    another model, prompt or setting into the same output is refused. See docs/datapipe.md."""
    s = Settings(model=model, output=output, inputs=list(inputs), **kw)
    try:
        meta = annotate(s, progress=not quiet, log=lambda m: click.echo(m, err=True))
    except AnnotateError as e:
        die(str(e))
    c = meta["counts"]
    click.echo(f"{c['done']:,} documents annotated: {c['scored']:,} scored, {c['unparseable']:,} unparseable "
               f"→ {output}")
