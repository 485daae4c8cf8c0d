"""End-to-end `datapipe build` of RL prompts (`format: prompts`: 200 arithmetic questions with answers, in
every record shape, plus bad records of every kind): tokens equal to transformers' apply_chat_template with
the generation prompt, answers and extra fields round-tripping through the shards, rejects counted by
reason, exact dedup on and MinHash near-dedup not collapsing the prompts, the held-out split by id, and
`storage inspect/verify` and `datapipe report` on the result."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from testutil import require, write_jsonl

from datapipe.cli import main as datapipe_cli
from datapipe.config import BuildConfig, ChatConfig, NormalizeConfig, SourceConfig, TokenizerConfig, ValidationConfig
from datapipe.demo import arithmetic_prompts
from datapipe.normalize import normalize_text
from datapipe.pipeline import Build
from datapipe.shardout import holdout_score
from storage.cli import main as storage_cli
from storage.config import ConfigError
from storage.loader import LoaderConfig
from storage.loader.prompts import PromptLoader, iter_prompts
from storage.manifest import read_manifest

U, A = "user", "assistant"
MAX_TOKENS = 160
FRACTION = 0.2


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


BAD = {  # id → (record, reason code); read-stage rejects
    "bad-missing": ({"question": "What is 1 + 1?", "answer": "2"}, "missing_prompt"),
    "bad-both": ({"prompt": "a", "messages": [msg(U, "a")]}, "bad_record"),
    "bad-type": ({"prompt": 5}, "bad_record"),
    "bad-messages-str": ({"messages": "hi"}, "bad_record"),
    "bad-empty": ({"messages": []}, "empty_conversation"),
    "bad-role": ({"messages": [msg("narrator", "x")]}, "unknown_role"),
    "bad-content": ({"messages": [msg(U, ["x"])]}, "non_string_content"),
    "bad-last-assistant": ({"messages": [msg(U, "What is 2 + 2?"), msg(A, "4")]}, "not_ending_with_user"),
    "bad-system-only": ({"messages": [msg("system", "Be brief.")]}, "not_ending_with_user"),
    "bad-blank": ({"prompt": " \n\u00a0"}, "empty_prompt"),
    "bad-answer-list": ({"prompt": "q1", "answer": ["4"]}, "bad_answer"),
    "bad-answer-bool": ({"prompt": "q2", "answer": True}, "bad_answer"),
    "bad-answer-blank": ({"prompt": "q3", "answer": "  "}, "bad_answer"),
}


def make_prompts(root: Path) -> tuple[dict[str, tuple[list, str | None, dict]], str]:
    """The JSONL file, and id → (messages as transformers should see them, answer, extra fields) of every
    record that must be kept."""
    recs, want = [], {}
    for i, r in enumerate(arithmetic_prompts(200, seed=3)):
        q, extra = r["prompt"], {}
        if i % 10 == 1:  # a conversation with a system turn
            rec = {"id": r["id"], "messages": [msg("system", "You are a calculator."), msg(U, q)], "answer": r["answer"]}
        elif i % 10 == 2:  # TRL's conversational prompt, earlier turns included; a numeric answer
            rec = {"id": r["id"], "prompt": [msg(U, "Hi"), msg(A, "Hello! Ask me a sum."), msg(U, q)],
                   "answer": int(r["answer"])}
        elif i % 10 == 3:  # no answer
            rec = {"id": r["id"], "prompt": q}
        elif i % 10 == 4:  # other fields travel as `extra`
            rec = {**r, "level": i % 3, "tags": ["arith", "easy"]}
            extra = {"level": i % 3, "tags": ["arith", "easy"]}
        else:
            rec = r
        recs.append(rec)
        p = rec.get("prompt", rec.get("messages"))
        want[f"arith/{r['id']}"] = ([msg(U, p)] if isinstance(p, str) else p,
                                    None if "answer" not in rec else str(rec["answer"]), extra)
    recs.append({"id": "ws", "prompt": "  Compute\u00a0seven times six.  \r\n", "answer": "42"})  # normalised
    want["arith/ws"] = ([msg(U, "Compute\u00a0seven times six.")], "42", {})
    recs.append({"id": "dup", "prompt": recs[0]["prompt"], "answer": "0"})  # the same prompt again: exact dup
    recs.append({"id": "too-long", "prompt": " ".join(f"step {k} of a long story;" for k in range(80)), "answer": "1"})
    recs += [{"id": k, **rec} for k, (rec, _) in BAD.items()]
    path = write_jsonl(root / "prompts" / "a.jsonl", recs)
    with open(path, "a") as fh:
        fh.write('["not", "an", "object"]\n{"id": "broken", "prompt": \n')
    return want, path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("promptsbuild")
    want, path = make_prompts(root / "in")
    cfg = BuildConfig(
        output=str(root / "out"),
        sources=[SourceConfig("arith", [path], format="prompts",
                              chat=ChatConfig(template="smollm3", max_tokens=MAX_TOKENS,
                                              template_vars={"enable_thinking": False}))],
        tokenizer=TokenizerConfig(vocab_size=512),
        validation=ValidationConfig(fraction=FRACTION),
    )  # MinHash near-dedup on (the default): the prompts must survive it
    Build(cfg).run(progress=False)
    return cfg, want


def _rejects(out: str, stage: str) -> dict[str, str]:
    got = {}
    for p in sorted(Path(out, "rejects", stage).glob("*.jsonl.gz")):
        with gzip.open(p, "rt") as fh:
            for line in fh:
                d = json.loads(line)
                got[d["id"]] = d["metadata"]["filter_reason"]
    return got


def test_manifest_stats_rejects_and_tools(built):
    cfg, want = built
    m = read_manifest(cfg.output)
    assert m.sources["arith"].kind == m.validation["arith"].kind == "prompts" and m.format_version == 1
    assert "<think>" in m.chat_template
    st = m.sources["arith"].stats
    reasons: dict[str, int] = {}
    for _, reason in BAD.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    reasons["bad_record"] += 1  # the JSON list
    assert {k[len("dropped_read:"):]: v for k, v in st.items() if k.startswith("dropped_read:")} == reasons
    assert st["dropped_read"] == len(BAD) + 2  # + a JSON list and a malformed line
    assert st["exact_duplicates"] == 1 and st["near_duplicates"] == 0 and st["dropped_too_long"] == 1
    assert st["documents"] + st["validation_documents"] == len(want) == 201
    assert st["with_answer"] == sum(a is not None for _, a, _ in want.values()) == 181
    assert st["read"] == st["dropped_read"] + st["exact_duplicates"] + st["dropped_too_long"] + len(want)
    read = _rejects(cfg.output, "read")
    for rid, (_, reason) in BAD.items():
        assert read[f"arith/{rid}"].startswith(reason + ":"), (rid, read[f"arith/{rid}"])
    assert _rejects(cfg.output, "tokenize")["arith/too-long"].startswith("too_long: the prompt has")
    assert set(_rejects(cfg.output, "exact_dup")) == {"arith/dup"}
    res = CliRunner().invoke(storage_cli, ["verify", cfg.output])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(storage_cli, ["inspect", cfg.output])
    assert res.exit_code == 0 and f"prompts source arith (RL prompts up to the generation prompt): " \
        f"{st['documents']} training + {st['validation_documents']} held out, 181 of all with an answer" in res.output
    res = CliRunner().invoke(datapipe_cli, ["report", cfg.output, "--no-charts"])
    assert res.exit_code == 0 and "prompts arith: " in res.output and "not_ending_with_user=2" in res.output \
        and "too_long=1" in res.output, res.output


def test_tokens_answers_and_extra_round_trip(built):
    """Every kept prompt, in both splits: ids equal transformers' apply_chat_template(messages,
    add_generation_prompt=True) on the normalised messages; answer (a number as its JSON text) and extra
    fields as in the record; the split is decided by the id's hash."""
    transformers = require("transformers")
    cfg, want = built
    m = read_manifest(cfg.output)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(cfg.output, "tokenizer.json")))
    norm = NormalizeConfig()
    seen = {}
    for split in ("train", "validation"):
        prompts = list(iter_prompts(cfg.output, split))
        assert [p.ordinal for p in prompts] == list(range(len(prompts)))
        for p in prompts:
            msgs, answer, extra = want[p.doc_id]
            msgs = [{**x, "content": normalize_text(x["content"], norm)} for x in msgs]
            ids = hf.apply_chat_template(msgs, chat_template=m.chat_template, add_generation_prompt=True,
                                         tokenize=True, return_dict=True, enable_thinking=False)["input_ids"]
            assert p.ids == list(ids), p.doc_id
            assert hf.decode(p.ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
            assert (p.answer, p.extra, p.source) == (answer, extra, "arith")
            assert (split == "validation") == (holdout_score("arith", p.doc_id) < FRACTION)
            seen[p.doc_id] = split
    assert set(seen) == set(want) and 20 < list(seen.values()).count("validation") < 60
    with pytest.raises(ValueError, match="split"):
        next(iter_prompts(cfg.output, "test"))


def test_loader_serves_the_built_training_prompts(built):
    cfg, _ = built
    ref = {p.ordinal: p for p in iter_prompts(cfg.output)}
    with PromptLoader(LoaderConfig(dataset=cfg.output, prefetch_threads=2), 16) as ld:
        assert ld.epoch_prompts == len(ref) and ld.max_prompt_tokens <= MAX_TOKENS
        got = [p for _ in range(-(-len(ref) // 16)) for p in next(ld)][:len(ref)]
    assert sorted(p.ordinal for p in got) == sorted(ref) and all(p == ref[p.ordinal] for p in got)


def test_prompts_config(tmp_path):
    from storage import config as cfgmod

    base = {"output": str(tmp_path), "sources": [{"name": "p", "paths": ["x"], "format": "prompts",
                                                 "chat": {"truncate": True}}]}
    with pytest.raises(ConfigError, match="key 'chat.truncate': prompts are never truncated"):
        cfgmod.from_dict(BuildConfig, base)
    base["sources"][0]["chat"] = {"template": "smollm3"}
    cfg = cfgmod.from_dict(BuildConfig, base)
    assert cfg.filters_for(cfg.sources[0]) == [] and cfg.sources[0].record_kind == "prompts"
    assert cfg.chat_template == "smollm3"
    bad = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 1 + 1?", "answer": "2"}] * 3)
    cfg.sources[0].paths = [bad]
    with pytest.raises(KeyError, match=r"fields 'prompt' or 'messages' not found in the first 3 records .* "
                                       r"\(fields there: answer, question\)"):
        Build(cfg)
