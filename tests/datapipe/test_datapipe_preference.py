"""End-to-end `datapipe build` of preference JSONL (TRL's explicit- and implicit-prompt shapes, bad pairs of
every kind): both sides of a pair adjacent in one block, tokens and masks equal to transformers'
apply_chat_template with the loss on the completion only, rejects counted by reason, exact dedup and the
validation split acting on whole pairs, iter_pairs reading them back."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from testutil import read_corpus, require, write_jsonl

from datapipe.config import (BuildConfig, ChatConfig, DedupConfig, MinhashSettings, NormalizeConfig, ShardsConfig,
                             SourceConfig, TokenizerConfig, ValidationConfig)
from datapipe.normalize import normalize_text
from datapipe.pipeline import Build
from storage.cli import main as storage_cli
from storage.config import ConfigError
from storage.dataset import Dataset, iter_documents
from storage.loader.pairs import iter_pairs
from storage.manifest import read_manifest

U, A = "user", "assistant"


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


BAD = {  # id → (record, reason code); read-stage rejects
    "bad-identical": ({"prompt": "q", "chosen": "same", "rejected": "same"}, "identical_completions"),
    "bad-identical-msgs": ({"prompt": "q", "chosen": "same", "rejected": [msg(A, "same")]}, "identical_completions"),
    "bad-empty": ({"prompt": "q", "chosen": "", "rejected": "r"}, "empty_completion"),
    "bad-blank": ({"prompt": "q", "chosen": "c", "rejected": " \n "}, "empty_completion"),
    "bad-empty-list": ({"prompt": "q", "chosen": [], "rejected": "r"}, "empty_completion"),
    "bad-role": ({"prompt": [msg("narrator", "x")], "chosen": "c", "rejected": "r"}, "unknown_role"),
    "bad-content": ({"prompt": "q", "chosen": "c", "rejected": 5}, "non_string_content"),
    "bad-content-msg": ({"prompt": [msg(U, ["x"])], "chosen": "c", "rejected": "r"}, "non_string_content"),
    "bad-missing": ({"prompt": "q", "chosen": "c"}, "missing_messages"),
    "bad-noprompt": ({"chosen": "c", "rejected": "r"}, "missing_prompt"),
    "bad-noshared": ({"chosen": [msg(U, "a"), msg(A, "b")], "rejected": [msg(U, "x"), msg(A, "y")]},
                     "missing_prompt"),
    "bad-noasst": ({"prompt": "q", "chosen": [msg(U, "c")], "rejected": "r"}, "no_assistant"),
}


def make_pairs(root: Path) -> tuple[list[dict], dict[str, tuple[list, list, list]], str]:
    """Records, and id → (prompt, chosen, rejected) messages as transformers should see them."""
    f = [d["text"] for d in read_corpus("fortunes", 400)]
    recs, want = [], {}
    for i in range(40):
        q, c, r = f[3 * i], f[3 * i + 1], f[3 * i + 2]
        if i % 7 == 0:  # implicit prompt: two full conversations sharing the prompt's messages
            prompt = [msg(U, q)]
            recs.append({"id": f"p{i}", "chosen": [*prompt, msg(A, c)], "rejected": [*prompt, msg(A, r)]})
        elif i % 3 == 0:  # a multi-turn prompt whose assistant turn must stay outside the loss
            prompt = [msg("system", f"You are judge {i}."), msg(U, "Hello"), msg(A, f[200 + i]), msg(U, q)]
            recs.append({"id": f"p{i}", "prompt": prompt, "chosen": [msg(A, c)], "rejected": r})
        elif i % 5 == 0:  # a completion of two assistant turns with a tool turn between
            prompt = [msg(U, q)]
            comp = [msg(A, c), msg("tool", json.dumps({"n": i})), msg(A, "done")]
            recs.append({"id": f"p{i}", "prompt": q, "chosen": comp, "rejected": r})
            want[f"p{i}"] = (prompt, comp, [msg(A, r)])
            continue
        else:
            prompt = [msg(U, q)]
            recs.append({"id": f"p{i}", "prompt": q, "chosen": c, "rejected": r})
        want[f"p{i}"] = (prompt, [msg(A, c)], [msg(A, r)])
    # same prompt and chosen as p1, another rejected: a different pair, kept
    recs.append({"id": "share-chosen", "prompt": f[3], "chosen": f[4], "rejected": f[250]})
    want["share-chosen"] = ([msg(U, f[3])], [msg(A, f[4])], [msg(A, f[250])])
    big = " ".join(f[330:360])[:1500]  # each side fits max_tokens, the pair is longer than a block
    recs.append({"id": "big", "prompt": big, "chosen": "yes", "rejected": "no"})
    want["big"] = ([msg(U, big)], [msg(A, "yes")], [msg(A, "no")])
    recs.append({"id": "dup-of-p2", "prompt": f[6], "chosen": f[7], "rejected": f[8]})  # the whole pair again
    recs.append({"id": "too-long", "prompt": "go", "chosen": " ".join(f[260:330]), "rejected": "short"})
    recs.append({"id": "long-prompt", "prompt": " ".join(f[300:400]), "chosen": "a", "rejected": "b"})
    recs += [{"id": k, **rec} for k, (rec, _) in BAD.items()]
    path = write_jsonl(root / "pref" / "a.jsonl", recs)
    with open(path, "a") as fh:
        fh.write('["not", "an", "object"]\n{"id": "broken", "chosen": [\n')
    return recs, want, path


def make_trunc(root: Path) -> tuple[dict[str, tuple[list, list, list]], str]:
    f = [d["text"] for d in read_corpus("fortunes", 100, start=400)]
    recs, want = [], {}
    for i in range(6):
        c, r = " ".join(f[5 * i:5 * i + 5]), f[50 + i]
        recs.append({"id": f"t{i}", "prompt": "go", "chosen": c, "rejected": r})
        want[f"t{i}"] = ([msg(U, "go")], [msg(A, c)], [msg(A, r)])
    recs.append({"id": "late", "prompt": " ".join(f[60:80]), "chosen": "x", "rejected": "y"})
    return want, write_jsonl(root / "ptrunc" / "a.jsonl", recs)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefbuild")
    _, want, path = make_pairs(root / "in")
    want_t, trunc_path = make_trunc(root / "in")
    cfg = BuildConfig(
        output=str(root / "out"),
        sources=[SourceConfig("pref", [path], format="preference", chat=ChatConfig(max_tokens=1024)),
                 SourceConfig("ptrunc", [trunc_path], format="preference",
                              chat=ChatConfig(max_tokens=48, truncate=True))],
        tokenizer=TokenizerConfig(vocab_size=1024, train_max_docs=400),
        dedup=DedupConfig(minhash=MinhashSettings(enabled=False)),
        shards=ShardsConfig(block_tokens=1024, shard_blocks=4),
        validation=ValidationConfig(fraction=0.3),
    )
    Build(cfg).run(progress=False)
    return cfg, {**want, **want_t}


def _rejects(out: str, stage: str) -> dict[str, str]:
    got = {}
    for p in sorted(Path(out, "rejects", stage).glob("*.jsonl.gz")):
        with gzip.open(p, "rt") as fh:
            for line in fh:
                d = json.loads(line)
                got[d["id"]] = d["metadata"]["filter_reason"]
    return got


def test_manifest_stats_and_rejects(built):
    cfg, want = built
    m = read_manifest(cfg.output)
    assert m.format_version == 2
    assert {n: s.kind for n, s in m.sources.items()} == {"pref": "preference", "ptrunc": "preference"}
    assert m.validation["pref"].kind == "preference"
    st = m.sources["pref"].stats
    reasons: dict[str, int] = {}
    for _, reason in BAD.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, n in reasons.items():
        assert st[f"dropped_read:{reason}"] == n, (reason, st)
    assert st["dropped_read"] == len(BAD) + 2  # + a JSON list and a malformed line
    assert st["dropped_read:bad_record"] == 1
    assert st["exact_duplicates"] == 1 and st["dropped_too_long"] == 1 and st["dropped_prompt_too_long"] == 1
    assert st["truncated"] == 0 and st["loss_tokens"] > 0
    n_pairs = len([k for k in want if not k.startswith("t")])
    assert st["documents"] + st["validation_documents"] == 2 * n_pairs
    assert st["pairs"] + st["validation_pairs"] == n_pairs and st["validation_pairs"] > 0
    ts = m.sources["ptrunc"].stats
    assert ts["truncated"] >= 4 and ts["dropped_prompt_too_long"] == 1
    read = _rejects(cfg.output, "read")
    for rid, (_, reason) in BAD.items():
        assert read[f"pref/{rid}"].startswith(reason + ":"), (rid, read[f"pref/{rid}"])
    tok = _rejects(cfg.output, "tokenize")
    assert tok["pref/too-long"].startswith("too_long: chosen has")
    assert tok["pref/long-prompt"].startswith("prompt_too_long:") and tok["ptrunc/late"].startswith("prompt_too_long")
    dup = _rejects(cfg.output, "exact_dup")
    assert set(dup) == {"pref/dup-of-p2"}  # the whole pair, once; share-chosen (one side equal) stays
    res = CliRunner().invoke(storage_cli, ["verify", cfg.output])
    assert res.exit_code == 0, res.output


def test_pairs_adjacent_in_one_block_and_split_together(built):
    cfg, want = built
    ds = Dataset.open(cfg.output)
    seen: dict[str, str] = {}
    own_block = 0
    for split, readers in (("train", ds.readers), ("validation", ds.validation_readers)):
        for name in ("pref", "ptrunc"):
            for rd in readers.get(name, []):
                for k in range(len(rd.index)):
                    b = rd.read_block(k)
                    ids = list(b.doc_ids)
                    assert len(ids) % 2 == 0, ids
                    for c, r in zip(ids[::2], ids[1::2]):
                        assert c.endswith("#chosen") and r == c[:-len("chosen")] + "rejected"
                        assert c[:-7] not in seen
                        seen[c[:-7]] = split
                    own_block += len(b.tokens) > cfg.shards.block_tokens
    assert set(seen) == {f"{'ptrunc' if k.startswith('t') else 'pref'}/{k}" for k in want}
    assert own_block >= 1  # a pair longer than a block got one of its own
    held = [k for k, s in seen.items() if s == "validation"]
    assert 0 < len(held) < len(seen) - 5
    from datapipe.shardout import holdout_score
    for k, s in seen.items():  # the pair id decides the split
        assert (s == "validation") == (holdout_score(k.split("/")[0], k) < 0.3)


def test_tokens_and_masks_equal_transformers_on_the_completion(built):
    transformers = require("transformers")
    cfg, want = built
    m = read_manifest(cfg.output)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(cfg.output, "tokenizer.json")))
    norm = NormalizeConfig()

    def normed(msgs):
        return [{**x, "content": normalize_text(x["content"], norm)} for x in msgs]

    seen = 0
    for name in ("pref", "ptrunc"):
        cut = 48 if name == "ptrunc" else None
        shards = m.sources[name].shards + (m.validation[name].shards if name in m.validation else [])
        for doc_id, toks, mask in iter_documents(cfg.output, shards, with_mask=True):
            key, side = doc_id.split("/", 1)[1].rsplit("#", 1)
            prompt, chosen, rejected = (normed(x) for x in want[key])
            conv = prompt + (chosen if side == "chosen" else rejected)
            full = hf.apply_chat_template(conv, chat_template=m.chat_template, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            p_ids = hf.apply_chat_template(prompt, chat_template=m.chat_template, tokenize=True, return_dict=True,
                                           add_generation_prompt=True)["input_ids"]
            ids, hf_mask = list(full["input_ids"]), list(full["assistant_masks"])
            assert ids[:len(p_ids)] == list(p_ids)
            expect = [0] * len(p_ids) + hf_mask[len(p_ids):]
            assert toks.tolist() == ids[:cut], doc_id
            assert mask.tolist() == expect[:cut], doc_id
            if any(x["role"] == A for x in prompt):  # the prompt's assistant turn: in HF's mask, not ours
                assert any(hf_mask[:len(p_ids)]) and not mask[:len(p_ids)].any()
            seen += 1
    assert seen == 2 * len(want)


def test_iter_pairs_reads_both_splits_in_dataset_order(built):
    cfg, want = built
    m = read_manifest(cfg.output)
    for split, sources in (("train", m.sources), ("validation", m.validation)):
        docs = [d for s in sources.values() for d in iter_documents(cfg.output, s.shards, with_mask=True)]
        pairs = list(iter_pairs(cfg.output, split))
        assert len(pairs) * 2 == len(docs) and [p[0] for p in pairs] == list(range(len(pairs)))
        for (o, pid, ct, cm, rt, rm), c, r in zip(pairs, docs[::2], docs[1::2]):
            assert c[0] == pid + "#chosen" and r[0] == pid + "#rejected"
            assert np.array_equal(ct, c[1]) and np.array_equal(cm, c[2]) and ct.dtype == np.int64
            assert np.array_equal(rt, r[1]) and np.array_equal(rm, r[2])
    with pytest.raises(ValueError, match="split"):
        next(iter_pairs(cfg.output, "test"))


def test_preference_config(tmp_path):
    from storage import config as cfgmod

    base = {"output": str(tmp_path), "sources": [{"name": "c", "paths": ["x"], "format": "chat"},
                                                 {"name": "p", "paths": ["x"], "format": "preference",
                                                  "chat": {"template": "smollm3"}}]}
    with pytest.raises(ConfigError, match="sources.1.chat.template"):
        cfgmod.from_dict(BuildConfig, base)
    base["sources"][1]["chat"] = {}
    cfg = cfgmod.from_dict(BuildConfig, base)
    assert cfg.filters_for(cfg.sources[1]) == [] and cfg.sources[1].record_kind == "preference"
    assert cfg.chat_template == "chatml"
