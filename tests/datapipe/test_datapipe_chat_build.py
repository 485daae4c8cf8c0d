"""End-to-end `datapipe build` of chat JSONL (with bad records of every kind) beside a pretraining source:
format 2 shards with loss masks equal to transformers' apply_chat_template, rejects counted by reason,
exact duplicates removed, truncation counted, stock tools and webdataset reading the shards, `storage
verify` catching a corrupt mask."""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import lz4.frame
import numpy as np
import pytest
from click.testing import CliRunner
from testutil import read_corpus, require, require_tool, write_jsonl

from storage.chat import BUILTIN_TEMPLATES
from datapipe.config import (BuildConfig, ChatConfig, NormalizeConfig, ShardsConfig, SourceConfig, TokenizerConfig,
                             ValidationConfig)
from datapipe.normalize import normalize_text
from datapipe.pipeline import Build
from storage.config import ConfigError
from storage.dataset import iter_documents
from storage.manifest import read_manifest
from storage.shards import ShardError, ShardReader

BAD = {  # id → (record, reason code)
    "bad-role": ({"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
                 "unknown_role"),
    "bad-content": ({"messages": [{"role": "user", "content": {"a": 1}}, {"role": "assistant", "content": "y"}]},
                    "non_string_content"),
    "bad-empty": ({"messages": []}, "empty_conversation"),
    "bad-noasst": ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
                   "no_assistant"),
    "bad-missing": ({"text": "not a conversation"}, "missing_messages"),
    "bad-completion": ({"prompt": "q", "completion": None}, "non_string_content"),
}


def make_chat(root: Path) -> tuple[list[dict], str]:
    f = [d["text"] for d in read_corpus("fortunes", 400)]
    recs = []
    for i in range(60):
        msgs = [{"role": "user", "content": f[3 * i]}, {"role": "assistant", "content": f[3 * i + 1]}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": f"You are assistant number {i}."})
        if i % 4 == 0:
            msgs += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": f[3 * i + 2]}]
        if i % 5 == 0:
            msgs[1:1] = [{"role": "tool", "content": json.dumps({"lookup": i})}]
        recs.append({"id": f"c{i}", "messages": msgs})
    recs += [{"id": f"pc{i}", "prompt": f[200 + 2 * i], "completion": f[201 + 2 * i]} for i in range(10)]
    recs.append({"id": "dup-of-c1", "messages": recs[1]["messages"]})
    recs.append({"id": "too-long", "messages": [{"role": "user", "content": " ".join(f[300:400])},
                                                {"role": "assistant", "content": "ok"}]})
    recs += [{"id": k, **rec} for k, (rec, _) in BAD.items()]
    path = write_jsonl(root / "chat" / "a.jsonl", recs)
    with open(path, "a") as fh:
        fh.write('{"id": "broken", "messages": [\n')  # malformed JSON
    return recs, path


def make_trunc(root: Path) -> tuple[list[dict], str]:
    f = [d["text"] for d in read_corpus("fortunes", 100, start=400)]
    recs = [{"id": f"t{i}", "messages": [{"role": "user", "content": "go"},
                                         {"role": "assistant", "content": " ".join(f[5 * i:5 * i + 5])}]}
            for i in range(8)]
    recs.append({"id": "late", "messages": [{"role": "user", "content": " ".join(f[40:60])},
                                            {"role": "assistant", "content": "late answer"}]})
    return recs, write_jsonl(root / "trunc" / "a.jsonl", recs)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatbuild")
    chat, chat_path = make_chat(root / "in")
    trunc, trunc_path = make_trunc(root / "in")
    web = write_jsonl(root / "in" / "web" / "a.jsonl", read_corpus("fortunes", 150, start=600))
    cfg = BuildConfig(
        output=str(root / "out"),
        sources=[SourceConfig("chat", [chat_path], format="chat", chat=ChatConfig(max_tokens=2048)),
                 SourceConfig("trunc", [trunc_path], format="chat", chat=ChatConfig(max_tokens=48, truncate=True)),
                 SourceConfig("web", [web], filters=[])],
        tokenizer=TokenizerConfig(vocab_size=1024, train_max_docs=400),
        shards=ShardsConfig(block_tokens=2048, shard_blocks=4),
        validation=ValidationConfig(fraction=0.2),
    )
    Build(cfg).run(progress=False)
    return cfg, {r["id"]: r for r in chat + trunc}, root


def _rejects(out: str, stage: str) -> dict[str, str]:
    got = {}
    for p in sorted(Path(out, "rejects", stage).glob("*.jsonl.gz")):
        with gzip.open(p, "rt") as fh:
            for line in fh:
                d = json.loads(line)
                got[d["id"]] = d["metadata"]["filter_reason"]
    return got


def test_manifest_stats_and_rejects(built):
    cfg, _, _ = built
    m = read_manifest(cfg.output)
    assert m.format_version == 2 and m.chat_template == BUILTIN_TEMPLATES["chatml"]
    assert {n: s.kind for n, s in m.sources.items()} == {"chat": "chat", "trunc": "chat", "web": "text"}
    assert all(v.kind == "chat" for n, v in m.validation.items() if n != "web") and "chat" in m.validation
    st = m.sources["chat"].stats
    reasons = {}
    for _, reason in BAD.values():
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, n in reasons.items():
        assert st[f"dropped_read:{reason}"] == n, (reason, st)
    assert st["dropped_read"] == len(BAD) + 1  # + the malformed JSON line
    assert st["exact_duplicates"] == 1 and st["dropped_too_long"] == 1 and st["truncated"] == 0
    assert st["loss_tokens"] > 0 and m.build_stats["dropped_read:unknown_role"] == 1
    assert st["documents"] + st["validation_documents"] == 70 - st["near_duplicates"]
    ts = m.sources["trunc"].stats
    assert ts["truncated"] == 8 and ts["dropped_too_long"] == 1
    read = _rejects(cfg.output, "read")
    for rid, (_, reason) in BAD.items():
        assert read[f"chat/{rid}"].startswith(reason + ":")
    assert any("malformed JSON" in r for r in read.values())
    tok = _rejects(cfg.output, "tokenize")
    assert tok["chat/too-long"].startswith("too_long:") and "nothing to train on" in tok["trunc/late"]
    assert "chat/dup-of-c1" in _rejects(cfg.output, "exact_dup") or "chat/c1" in _rejects(cfg.output, "exact_dup")


def test_tokens_and_masks_equal_transformers(built):
    transformers = require("transformers")
    cfg, records, _ = built
    m = read_manifest(cfg.output)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(cfg.output, "tokenizer.json")))
    for t in ("<|im_start|>", "<|im_end|>"):
        assert len(hf.encode(t, add_special_tokens=False)) == 1
    from storage.chat import validate_conversation

    seen = 0
    for name in ("chat", "trunc"):
        shards = m.sources[name].shards + (m.validation[name].shards if name in m.validation else [])
        for doc_id, toks, mask in iter_documents(cfg.output, shards, with_mask=True):
            msgs = validate_conversation(records[doc_id.split("/", 1)[1]])
            for msg in msgs:
                msg["content"] = normalize_text(msg["content"], NormalizeConfig())
            want = hf.apply_chat_template(msgs, chat_template=m.chat_template, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            cut = 48 if name == "trunc" else None
            assert toks.tolist() == list(want["input_ids"])[:cut], doc_id
            assert mask.tolist() == list(want["assistant_masks"])[:cut], doc_id
            assert toks[-1] != m.tokenizer.eos_id  # conversations carry no EOS
            seen += 1
    assert seen >= 70
    for _, toks, mask in iter_documents(cfg.output, m.sources["web"].shards, with_mask=True):
        assert mask is None and toks[-1] == m.tokenizer.eos_id


def test_stock_tools_read_chat_shard(built, tmp_path):
    cfg, _, _ = built
    shard = Path(cfg.output, read_manifest(cfg.output).sources["chat"].shards[0].path)
    names = subprocess.run(["tar", "-tf", str(shard)], capture_output=True, text=True, check=True).stdout.split()
    assert names[:3] == ["shard-00000-0000_000000.tokens.lz4", "shard-00000-0000_000000.json",
                         "shard-00000-0000_000000.mask.lz4"]
    block = ShardReader(str(shard)).read_block(0)
    require_tool("lz4")
    with tarfile.open(shard) as tar:
        (tmp_path / "m.lz4").write_bytes(tar.extractfile(names[2]).read())
    raw = subprocess.run(["lz4", "-dc", str(tmp_path / "m.lz4")], capture_output=True, check=True).stdout
    assert raw == block.mask.tobytes()
    import webdataset as wds

    sample = next(iter(wds.WebDataset(str(shard), shardshuffle=False)))
    assert np.frombuffer(lz4.frame.decompress(sample["mask.lz4"]), np.uint8).tolist() == block.mask.tolist()
    assert json.loads(sample["json"])["format"] == 2


def test_verify_and_corrupt_mask(built, tmp_path):
    from storage.cli import main

    cfg, _, _ = built
    res = CliRunner().invoke(main, ["verify", cfg.output])
    assert res.exit_code == 0, res.output
    copy = tmp_path / "copy"
    shutil.copytree(cfg.output, copy, ignore=shutil.ignore_patterns("_work", "rejects"))
    rel = read_manifest(str(copy)).sources["chat"].shards[0].path
    shard = copy / rel
    e = ShardReader(str(shard)).index[0]
    data = bytearray(shard.read_bytes())
    data[e.mask_offset + 512 + e.mask_size // 2] ^= 0x5A
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError) as ei:
        ShardReader(str(shard)).read_block(0)
    assert ei.value.member == f"{e.key}.mask.lz4"
    res = CliRunner().invoke(main, ["verify", str(copy)])
    assert res.exit_code == 1 and "mask.lz4" in res.output


def test_given_tokenizer_without_chat_tokens_is_a_config_error(tmp_path, small_tokenizer):
    _, chat_path = make_trunc(tmp_path / "in")
    cfg = BuildConfig(output=str(tmp_path / "out"), tokenizer=TokenizerConfig(path=small_tokenizer),
                      sources=[SourceConfig("c", [chat_path], format="chat")])
    with pytest.raises(ConfigError, match=r"lacks the chat template's special tokens \['<\|im_start\|>', "
                                          r"'<\|im_end\|>'\]"):
        Build(cfg)


def test_chat_config_errors(tmp_path):
    from storage import config as cfgmod

    base = {"output": str(tmp_path), "sources": [{"name": "c", "paths": ["x"], "format": "chat",
                                                  "chat": {"max_tokens": 0}}]}
    with pytest.raises(ConfigError, match="chat.max_tokens"):
        cfgmod.from_dict(BuildConfig, base)
    base["sources"][0]["chat"] = {"train_on": "users"}
    with pytest.raises(ConfigError, match="sources.0.chat.train_on"):
        cfgmod.from_dict(BuildConfig, base)
    base["sources"] = [{"name": "a", "paths": ["x"], "format": "chat"},
                       {"name": "b", "paths": ["x"], "format": "chat", "chat": {"template": "smollm3"}}]
    with pytest.raises(ConfigError, match="sources.1.chat.template"):
        cfgmod.from_dict(BuildConfig, base)
