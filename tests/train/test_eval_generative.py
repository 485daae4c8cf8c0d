"""Generative evaluation (train.eval.generative): on the tiny Llama of tests/train/conftest.py, `train eval
--hf` gives the same generations, extracted answers and per-item scores as lm-evaluation-harness's HF
backend (batch size 1) for gsm8k_cot, and with the chat template for gsm8k_cot_chat and ifeval; a checkpoint evaluated under
TP=2 (its weights mirrored from the Megatron model) gives the same generations; bad input is one line
naming the key, file and line; `train eval --table` shows the generative columns."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from testutil import require

require("lm_eval")
N_NEW = 16
LIMIT = 3


@pytest.fixture(scope="module")
def hf_results(tiny_hf, tmp_path_factory):
    from train.cli import main

    out = tmp_path_factory.mktemp("geneval") / "eval.json"
    r = CliRunner().invoke(main, ["eval", "--hf", tiny_hf[0], "--tasks", "gsm8k_cot,gsm8k_cot_chat,ifeval",
                                  "--limit", str(LIMIT),
                                  "--set", f"eval.generation.max_new_tokens={N_NEW}", "--out", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "gsm8k_cot" in r.output and "inst_level_loose_acc" in r.output
    return json.loads(out.read_text())["tasks"]


@pytest.mark.parametrize("task,yaml_path,chat", [("gsm8k_cot", "gsm8k/gsm8k-cot.yaml", False),
                                                 ("gsm8k_cot_chat", "gsm8k/gsm8k-cot-zeroshot.yaml", True),
                                                 ("ifeval", "ifeval/ifeval.yaml", True)])
def test_same_generations_and_scores_as_lm_eval(tiny_hf, hf_results, tmp_path, task, yaml_path, chat):
    from train.eval.generative import read_docs
    from train.eval.lmeval import run_lmeval_generative

    ours = hf_results[task]
    assert ours["chat"] is chat and ours["metrics"]["items"] == LIMIT
    _, docs, _ = read_docs(task, LIMIT)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    ref = run_lmeval_generative(tiny_hf[0], yaml_path, str(tmp_path / "docs.jsonl"), str(tmp_path / "lm"),
                                batch_size=1, apply_chat_template=chat, max_gen_toks=N_NEW)
    assert [it["generation"] for it in ours["items"]] == ref["generations"]
    assert any(g.strip() for g in ref["generations"])  # the model wrote something
    for it, want, filt in zip(ours["items"], ref["per_item"], ref["filtered"], strict=True):
        assert {k: v for k, v in it.items() if k in want} == want
        assert {k.split(",", 1)[1]: v for k, v in it.items() if k.startswith("filtered,")} == \
            {k: v for k, v in filt.items() if k != "none"}
    for k, v in ours["metrics"].items():
        if k != "items":
            assert v == pytest.approx(float(ref["results"][k if "," in k else f"{k},none"]))


def test_a_checkpoint_under_tp2_generates_what_its_export_generates(tiny_ckpt, hf_results, tmp_path):
    from train.cli import main

    r = CliRunner().invoke(main, ["eval", tiny_ckpt, "--tasks", "gsm8k_cot", "--limit", str(LIMIT),
                                  "--nproc", "2", "--set", "parallel.tp=2", "--set", "data.seq_len=64",
                                  "--set", f"eval.generation.max_new_tokens={N_NEW}", "--validation-tokens", "0",
                                  "--out", str(tmp_path / "res")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    (res,) = [json.loads(p.read_text()) for p in (tmp_path / "res").glob("*.json")]
    assert res["layout"]["tp"] == 2
    got = res["tasks"]["gsm8k_cot"]
    assert [it["generation"] for it in got["items"]] == [it["generation"] for it in hf_results["gsm8k_cot"]["items"]]
    assert res["metrics"]["eval/gsm8k_cot/exact_match/strict-match"] == got["metrics"]["exact_match,strict-match"]
    r = CliRunner().invoke(main, ["eval", "--table", str(tmp_path / "res")])
    assert r.exit_code == 0 and "gsm8k_cot strict" in r.output and "gsm8k_cot flex" in r.output, r.output


def test_bad_input_is_one_line_naming_the_key_file_and_line(tiny_hf, tmp_path):
    from train.cli import main

    folder = tiny_hf[0]
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n{"question": "2 + 2?"}\n')
    cases = [(["--tasks", "gsm8k_cott"], "unknown task 'gsm8k_cott'; available: hellaswag"),
             (["--tasks", "gsm8k_cot", "--set", "eval.generation.max_new_token=8"], "eval.generation.max_new_token"),
             (["--tasks", f"gsm8k_cot={bad}"], f"{bad}:2: missing field 'answer'"),
             (["--tasks", "ifeval", "--set", "eval.generation.batch_size=0"], "key 'eval.generation.batch_size'"),
             (["--tasks", "ifeval", "--set", "eval.generation.prompt_lookup=-1"],
              "key 'eval.generation.prompt_lookup'")]
    for args, want in cases:
        r = CliRunner().invoke(main, ["eval", "--hf", folder, *args])
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert r.exit_code == 2 and len(errors) == 1 and want in errors[0], (args, r.output)
        assert "Traceback" not in r.output, r.output
    r = CliRunner().invoke(main, ["eval", "--hf", folder, "--tasks", "gsm8k_cott"])
    assert "generative: gsm8k_cot, gsm8k_cot_chat, ifeval" in r.output


def test_ifeval_scores_do_not_depend_on_the_callers_random_state(tiny_hf):
    """lm-eval's letter-frequency checker draws a random letter for prompts whose letter is not a-z (keys 1122
    '#', 1129 '!'): scored raw, the same text gets different results under different random states; our
    scorer seeds per doc, so it gets one."""
    import random

    from train.eval.generative import GenerativeTask
    from train.generation.load import load

    _, tok, template, _ = load(tiny_hf[0])
    task = GenerativeTask("ifeval", None, tok, max_length=512, chat_template=template, max_new_tokens=8)
    from lm_eval.tasks.ifeval import utils  # (after the task set up NLTK's data path: no download attempt)
    docs = {inst.doc["key"]: i for i, inst in enumerate(task.instances)}
    text = " ".join(c * 10 for c in "abcdefghijklm")  # half the letters 10 times, half never: 'at least 4' flips
    raw = set()
    for seed in range(20):
        random.seed(seed)
        raw.add(tuple(utils.process_results(task.instances[docs[1122]].doc, [text])["inst_level_strict_acc"]))
    assert len(raw) > 1  # lm-eval's own scoring of this prompt depends on the random state
    texts = [text] * len(task.instances)
    scored = []
    for seed in (0, 1, 2):
        random.seed(seed)
        _, details = task.score(texts)
        scored.append([(it["inst_level_strict_acc"], it["inst_level_loose_acc"]) for it in details["items"]])
    assert scored[0] == scored[1] == scored[2]


def test_limit_first_takes_the_first_items_and_every_item_records_its_index_and_question(tiny_hf):
    """`--limit N --first` is lm-eval's --limit (the task's first N docs); the default subsample is spread
    over the task; either way each result item says which doc of the task's data it is (index, question)."""
    from storage.evaltasks import load_task
    from train.eval.generative import GenerativeTask, pick, read_all_docs
    from train.generation.load import load

    _, tok, template, _ = load(tiny_hf[0])
    _, docs, _ = read_all_docs("gsm8k_cot")
    for first, want in ((True, [0, 1, 2, 3, 4]), (False, pick("gsm8k_cot", len(docs), 5))):
        task = GenerativeTask("gsm8k_cot", 5, tok, max_length=512, chat_template=template, max_new_tokens=4,
                              first=first)
        _, details = task.score(["The answer is 3."] * 5)
        got = [(it["index"], it["question"]) for it in details["items"]]
        assert got == [(i, docs[i]["question"]) for i in want], (first, got)
    assert want != [0, 1, 2, 3, 4] and max(want) > len(docs) // 2  # the subsample reaches across the data
    every = load_task("arc_easy").items
    assert [it.item_id for it in load_task("arc_easy", 5, first=True).items] == [it.item_id for it in every[:5]]
