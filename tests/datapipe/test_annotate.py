"""`datapipe annotate` (datapipe.quality.annotate) on a tiny random Llama saved as a Hugging Face folder: the
replies and parsed scores equal transformers' own greedy `generate` at batch size 1 on the same prompts
(parsed and unparseable replies both present), a run killed with SIGKILL after its first batch (a torn
last line added) resumes to the uninterrupted run's output and meta byte for byte, and a rerun with another
prompt or model into the same output, or bad input, is refused with one line naming the option."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from testutil import read_corpus, write_jsonl
from tinyllama import CHAT_TOKENS, EOS, random_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = "Rate this text.\n{text}\nScore:"
REGEX = r"(YRACUS|[0-9]+)"   # the random model writes this token in some replies, not in others
N_SAMPLE, BATCH = 12, 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF folder of a tiny random Llama with a BPE tokenizer, input JSONL of 30 documents, template file)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from datapipe.tokenize import train_bpe

    base = tmp_path_factory.mktemp("annotate")
    texts = [d["text"] for d in read_corpus("shakespeare", 300)] + [d["text"] for d in read_corpus("fortunes", 300)]
    raw = Tokenizer.from_file(train_bpe(texts, 1000, EOS, str(base / "tok" / "tokenizer.json"),
                                        special_tokens=CHAT_TOKENS))
    model = random_llama(raw.get_vocab_size())
    model.generation_config.eos_token_id = raw.token_to_id(EOS)
    hf = base / "hf"
    model.save_pretrained(hf)
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS, pad_token=EOS).save_pretrained(hf)
    docs = [{"id": f"f{i}", "text": d["text"]} for i, d in enumerate(read_corpus("fortunes", 30, start=300))]
    (base / "prompt.txt").write_text(TEMPLATE, encoding="utf-8")
    return str(hf), write_jsonl(base / "in" / "docs.jsonl", docs), str(base / "prompt.txt")


def args(tiny, output: str, prompt: str | None = None) -> list[str]:
    hf, docs, template = tiny
    return ["annotate", docs, "--model", hf, "--output", output, "--prompt", prompt or template,
            "--score-regex", REGEX, "--sample", str(N_SAMPLE), "--seed", "1", "--batch-size", str(BATCH),
            "--max-new-tokens", "16", "--max-chars", "200", "--no-chat", "--quiet"]


def run_cli(argv: list[str]):
    from datapipe.cli import main

    return CliRunner().invoke(main, argv)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> str:
    """The output of one uninterrupted run."""
    out = str(tmp_path_factory.mktemp("ref") / "ann.jsonl")
    r = run_cli(args(tiny, out))
    assert r.exit_code == 0, r.output + repr(r.exception)
    return out


def read(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_replies_and_scores_equal_transformers_greedy_generate(tiny, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    hf, docs, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    texts = {d["id"]: d["text"] for d in read(docs)}
    recs = read(reference)
    assert len(recs) == N_SAMPLE and len({r["id"] for r in recs}) == N_SAMPLE
    assert [r["id"] for r in recs] == [i for i in texts if i in {r["id"] for r in recs}]  # input order
    for r in recs:
        assert r["text"] == texts[r["id"]][:200]
        ids = tok(TEMPLATE.replace("{text}", r["text"]), add_special_tokens=False)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(
                max_new_tokens=16, do_sample=False, eos_token_id=[tok.eos_token_id], pad_token_id=tok.eos_token_id,
                suppress_tokens=list(range(len(tok), model.config.vocab_size))))[0, len(ids):].tolist()
        if y and y[-1] == tok.eos_token_id:
            y = y[:-1]
        reply = tok.decode(y, skip_special_tokens=True)
        found = re.findall(REGEX, reply)
        score = (int(found[-1]) if found[-1].isdigit() else found[-1]) if found else None
        assert (r["reply"], r["score"]) == (reply, score), r["id"]
    n_scored = sum(r["score"] is not None for r in recs)
    assert 0 < n_scored < N_SAMPLE, [r["reply"] for r in recs]  # both paths: parsed and unparseable
    with open(reference + ".meta.json", encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["counts"] == {"done": N_SAMPLE, "scored": n_scored, "unparseable": N_SAMPLE - n_scored,
                              "complete": True}
    assert meta["model_fingerprint"].startswith("sha256:") and meta["backend"] == "padded"


def test_a_killed_run_resumes_to_the_uninterrupted_output(tiny, reference, tmp_path):
    out = str(tmp_path / "ann.jsonl")
    # the CLI in a process whose generation pauses after its first batch, so that SIGKILL lands mid-run
    code = ("import sys, time\n"
            "from train.generation import engine\n"
            "gen, calls = engine.Engine.generate, []\n"
            "def slow(self, *a, **k):\n"
            "    calls.append(1)\n"
            "    if len(calls) > 1: time.sleep(120)\n"
            "    return gen(self, *a, **k)\n"
            "engine.Engine.generate = slow\n"
            "from datapipe.cli import main\n"
            "main(sys.argv[1:])\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code, *args(tiny, out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    try:
        while not (os.path.exists(out) and open(out, "rb").read().endswith(b"\n")):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "no batch written"
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL
        proc.wait()
    assert len(read(out)) == BATCH
    with open(out, "ab") as f:  # and a last line torn by the kill
        f.write(b'{"id": "f9", "text": "Do')
    r = run_cli(args(tiny, out))
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert f"{BATCH} of {N_SAMPLE} documents already annotated" in r.output
    for suffix in ("", ".meta.json"):
        with open(out + suffix, "rb") as a, open(reference + suffix, "rb") as b:
            assert a.read() == b.read(), suffix


def test_another_prompt_or_model_or_bad_input_is_refused_in_one_line(tiny, reference, tmp_path):
    hf, docs, _ = tiny
    before = open(reference, "rb").read()
    other = tmp_path / "other.txt"
    other.write_text("Grade this.\n{text}\nGrade:", encoding="utf-8")
    r = run_cli(args(tiny, reference, str(other)))
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "another prompt (template sha256)" in r.output, r.output
    moved = tmp_path / "hf2"
    shutil.copytree(hf, moved)
    cfg = json.loads((moved / "generation_config.json").read_text())
    (moved / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": [0, 1]}))
    argv = args(tiny, reference)
    argv[argv.index("--model") + 1] = str(moved)
    r = run_cli(argv)
    assert r.exit_code == 1 and "another model (fingerprint)" in r.output, r.output
    assert open(reference, "rb").read() == before
    nobrace = tmp_path / "nobrace.txt"
    nobrace.write_text("no placeholder", encoding="utf-8")
    bad = {"--prompt": (str(nobrace), "has no {text}"), "--score-regex": ("(a)(b)", "exactly one group"),
           "--model": (str(tmp_path / "missing"), "no such file"),
           "INPUTS": (str(tmp_path / "none.jsonl"), "No such file")}
    for opt, (value, says) in bad.items():
        argv = args(tiny, str(tmp_path / "x.jsonl"))
        if opt == "INPUTS":
            argv[1] = value
        else:
            argv[argv.index(opt) + 1] = value
        r = run_cli(argv)
        assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
        assert r.output.startswith(f"error: {opt}") and says in r.output and value in r.output, r.output
    assert not os.path.exists(tmp_path / "x.jsonl")
