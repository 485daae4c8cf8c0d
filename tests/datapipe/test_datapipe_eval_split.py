"""`datapipe build` for evaluation: the held-out validation split (hash rule, caps, shards, manifest,
reader) and n-gram decontamination against eval task files (normalisation, rejects, counts)."""
from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner
from datatrove.utils.text import simplify_text
from testutil import read_corpus, write_jsonl

from datapipe.config import (BuildConfig, DecontaminateConfig, ShardsConfig, SourceConfig, TokenizerConfig,
                             ValidationConfig)
from datapipe.decontaminate import DecontIndex, index_text, load_index
from datapipe.pipeline import Build
from storage import config as cfgmod
from storage.cli import main as storage_cli
from storage.config import ConfigError
from storage.dataset import Dataset, iter_documents
from storage.evaltasks import Item, Request, TaskError
from storage.manifest import read_manifest

FRACTION, MAX_DOCS, MAX_TOKENS = 0.1, 20, 2500
SEED = 0x5EED_0001  # the rule is frozen here on purpose: changing it moves every dataset's held-out set


def _words(doc: dict, start: int, n: int) -> list[str]:
    return doc["text"].split()[start:start + n]


def _shout(text: str) -> str:
    """The same words with other casing, punctuation and line breaks (normalisation must undo it)."""
    out = []
    for i, w in enumerate(text.split()):
        out.append(w.upper() if i % 2 else w.title())
        out.append(",\n" if i % 4 == 3 else " -- " if i % 5 == 4 else " ")
    return "".join(out).strip() + "!!"


def _task_file(path: Path, items: list[tuple[str, str, str]]) -> str:
    """Flat-shape task JSONL: per item a gold candidate (label 0) and a distractor."""
    rows = []
    for item_id, question, answer in items:
        rows += [{"doc_id": item_id, "context": question, "continuation": " " + answer, "label": 0},
                 {"doc_id": item_id, "context": question, "continuation": " purple elephants", "label": 0}]
    return write_jsonl(path, rows)


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_tokenizer):
    root = tmp_path_factory.mktemp("evalsplit")
    web, docs = read_corpus("fortunes", 500), read_corpus("pydoc", 80)
    plays = [d for d in read_corpus("shakespeare", 40) if d["text"].isascii()]
    # eval items: (id, question, answer) from play text that is not in the training sources
    quiz = [(f"q{i}", " ".join(_words(d, 40, 15)), " ".join(_words(d, 55, 10))) for i, d in enumerate(plays[:6])]
    trivia = [("t0", " ".join(_words(plays[6], 80, 6)), " ".join(_words(plays[6], 86, 4))),  # 10 words: whole
              ("t1", " ".join(_words(plays[7], 80, 20)), " ".join(_words(plays[7], 100, 8))),
              ("t2", " ".join(_words(plays[8], 80, 3)), " ".join(_words(plays[8], 83, 2)))]  # 5 words: skipped
    text = {k: f"{q} {a}" for k, q, a in quiz + trivia}
    q2 = text["q2"].split()
    plants = {  # training doc id -> (task, item, planted text)
        "web/fortunes/art/10": ("quiz", "q0", _shout(text["q0"])),
        "web/fortunes/art/77": ("quiz", "q1", text["q1"].lower()),
        "docs/pydoc/about.rst.txt/2": ("quiz", "q2", _shout(" ".join(q2[8:22]))),  # 14 words across q/a
        "web/fortunes/art/120": ("trivia", "t0", _shout(text["t0"])),
        "web/fortunes/art/300": ("trivia", "t1", _shout(text["t1"])),
    }
    kept_plant = "web/fortunes/art/200"  # t2 is below min_words: not indexed, so this document stays
    for d in web + docs:
        src = "web" if d in web else "docs"
        key = f"{src}/{d['id']}"
        if key in plants:
            d["text"] = f"{d['text']}\n\n{plants[key][2]}\n"
        elif key == kept_plant:
            d["text"] = f"{d['text']}\n\n{_shout(text['t2'])}\n"
    assert set(plants) | {kept_plant} <= {f"web/{d['id']}" for d in web} | {f"docs/{d['id']}" for d in docs}
    inputs = {"web": [write_jsonl(root / "in" / "web" / "a.jsonl", web[:250]),
                      write_jsonl(root / "in" / "web" / "b.jsonl", web[250:])],
              "docs": [write_jsonl(root / "in" / "docs" / "pydoc.jsonl", docs)]}
    tasks = [f"quiz={_task_file(root / 'quiz.jsonl', quiz)}", f"trivia={_task_file(root / 'trivia.jsonl', trivia)}"]
    cfg = BuildConfig(
        output=str(root / "out"),
        sources=[SourceConfig("docs", inputs["docs"], filters=[]),
                 SourceConfig("web", [str(root / "in" / "web" / "*.jsonl")], filters=[])],
        tokenizer=TokenizerConfig(path=small_tokenizer),
        shards=ShardsConfig(block_tokens=512, shard_blocks=2),
        validation=ValidationConfig(fraction=FRACTION, max_documents=MAX_DOCS, max_tokens=MAX_TOKENS),
        decontaminate=DecontaminateConfig(tasks=tasks, n_grams=13),
    )
    Build(cfg).run(progress=False)
    return cfg, inputs, plants, text, root


def _shard_docs(cfg, sources) -> dict[str, dict[str, int]]:
    """source -> {doc id: tokens} of the listed shards, read back with the public reader."""
    out = {}
    for name, info in sources.items():
        docs = out.setdefault(name, {})
        for doc_id, toks in iter_documents(cfg.output, info.shards):
            assert doc_id not in docs
            docs[doc_id] = len(toks)
    return out


def _input_ids(paths: list[str]) -> list[str]:
    return [json.loads(line)["id"] for p in paths for line in Path(p).read_text().splitlines()]


def _rejects(out: str, folder: str) -> list[dict]:
    rows = []
    for p in sorted(Path(out, "rejects", folder).glob("*.jsonl.gz")):
        with gzip.open(p, "rt") as f:
            rows += [json.loads(line) for line in f]
    return rows


def _reaching_shards(cfg) -> set[str]:
    """Ids that passed exact and near dedup (the input of decontamination)."""
    passed_filters = {i for p in Path(cfg.output, "_work", "ids").glob("*.json") for i in json.loads(p.read_text())}
    return passed_filters - {d["id"] for folder in ("exact_dup", "near_dup") for d in _rejects(cfg.output, folder)}


# ------------------------------------------------------------------------------------------ validation
def test_held_out_documents_follow_the_hash_rule_and_caps(built):
    cfg, inputs, _, _, _ = built
    m = read_manifest(cfg.output)
    train, val = _shard_docs(cfg, m.sources), _shard_docs(cfg, m.validation)
    assert set(m.validation) == {"web", "docs"}
    bound = set()
    for name in ("web", "docs"):
        assert not set(train[name]) & set(val[name])  # a held-out document is in no training shard
        every = {**train[name], **val[name]}
        scored = sorted((xxhash.xxh64_intdigest(f"{name}\0{i}".encode(), seed=SEED) / 2**64, i) for i in every)
        cands = [i for score, i in scored if score < FRACTION]
        expect, tokens = [], 0
        for i in cands:
            if len(expect) + 1 > MAX_DOCS or tokens + every[i] > MAX_TOKENS:
                bound.add(name)
                break
            expect.append(i)
            tokens += every[i]
        assert expect and set(val[name]) == set(expect), name
        assert len(val[name]) <= MAX_DOCS and sum(val[name].values()) <= MAX_TOKENS
        st = m.sources[name].stats
        assert (st["validation_documents"], st["validation_tokens"]) == (len(val[name]), sum(val[name].values()))
        assert (m.validation[name].documents, m.validation[name].tokens) == (len(val[name]), sum(val[name].values()))
        # every document that survived dedup and decontamination is in exactly one of the two splits
        assert st["read"] == st["exact_duplicates"] + st["near_duplicates"] + st["decontaminated"] + \
            st["documents"] + st["validation_documents"]
        # the reader yields held-out documents in input order
        assert list(val[name]) == [f"{name}/{i}" for i in _input_ids(inputs[name]) if f"{name}/{i}" in val[name]]
    assert bound == {"web", "docs"}  # the caps took effect in both sources (documents: web, tokens: docs)
    assert m.build_stats["validation_documents"] == sum(len(v) for v in val.values())


def test_validation_shards_are_listed_with_sha256_and_verified(built, tmp_path):
    cfg, _, _, _, _ = built
    m = read_manifest(cfg.output)
    n_val = 0
    assert len(m.validation["web"].shards) >= 2  # block_tokens=512, shard_blocks=2: several shards
    for name, info in m.validation.items():
        for k, sh in enumerate(info.shards):
            assert sh.path == f"validation/{name}/shard-{k:06d}.tar"
            data = Path(cfg.output, sh.path).read_bytes()
            assert hashlib.sha256(data).hexdigest() == sh.sha256 and len(data) == sh.bytes
            assert Path(cfg.output, sh.path + ".idx").exists()
            n_val += 1
    assert sorted(p.relative_to(cfg.output).as_posix() for p in Path(cfg.output, "validation").rglob("*.tar")) == \
        sorted(sh.path for info in m.validation.values() for sh in info.shards)
    n_train = sum(len(s.shards) for s in m.sources.values())
    res = CliRunner().invoke(storage_cli, ["verify", cfg.output])
    assert res.exit_code == 0 and f"ok: {n_train + n_val} shards verified" in res.output, res.output
    shown = json.loads(CliRunner().invoke(storage_cli, ["inspect", cfg.output, "--json"]).output)
    assert shown["validation"]["web"]["documents"] == m.validation["web"].documents
    # a corrupt validation shard fails `storage verify`, named
    copy = tmp_path / "ds"
    shutil.copytree(cfg.output, copy, ignore=shutil.ignore_patterns("_work", "rejects"))
    bad = copy / m.validation["docs"].shards[-1].path
    data = bytearray(bad.read_bytes())
    data[700] ^= 0xFF
    bad.write_bytes(bytes(data))
    res = CliRunner().invoke(storage_cli, ["verify", str(copy)])
    assert res.exit_code == 1 and m.validation["docs"].shards[-1].path in res.output, res.output


def test_dataset_without_validation_field_still_reads(built, tmp_path):
    cfg, _, _, _, _ = built
    old = tmp_path / "old"
    shutil.copytree(cfg.output, old, ignore=shutil.ignore_patterns("_work", "rejects", "validation"))
    data = json.loads((old / "manifest.json").read_text())
    del data["validation"]  # the shape written before the held-out split existed
    (old / "manifest.json").write_text(json.dumps(data))
    m = read_manifest(str(old))
    assert m.validation == {} and m.format_version == 1
    ds = Dataset.open(str(old))
    assert ds.validation_readers == {} and set(ds.readers) == {"docs", "web"}
    n = sum(1 for src in m.sources.values() for _ in iter_documents(str(old), src.shards))
    assert n == sum(s.documents for s in m.sources.values())
    res = CliRunner().invoke(storage_cli, ["verify", str(old)])
    assert res.exit_code == 0, res.output


def test_validation_config_is_checked():
    for bad, msg in [({"fraction": 1.0}, "validation.fraction"), ({"fraction": -0.1}, "validation.fraction"),
                     ({"max_documents": 0}, "validation.max_documents"), ({"max_tokens": 0}, "validation.max_tokens")]:
        with pytest.raises(ConfigError, match=msg):
            cfgmod.from_dict(BuildConfig, {"validation": bad})
    with pytest.raises(ConfigError, match="decontaminate.n_grams"):
        cfgmod.from_dict(BuildConfig, {"decontaminate": {"n_grams": 0}})
    with pytest.raises(ConfigError, match="plain folder name"):
        cfgmod.from_dict(BuildConfig, {"sources": [{"name": "validation", "paths": ["x"]}]})
    assert not cfgmod.from_dict(BuildConfig, {"validation": {"fraction": 0}}).validation.enabled


# --------------------------------------------------------------------------------------- decontamination
def test_planted_eval_items_are_dropped_and_nothing_else(built):
    cfg, _, plants, text, _ = built
    m = read_manifest(cfg.output)
    kept = {i for split in (_shard_docs(cfg, m.sources), _shard_docs(cfg, m.validation))
            for docs in split.values() for i in docs}
    reaching = _reaching_shards(cfg)
    assert set(plants) <= reaching  # the planted documents were not removed earlier for another reason
    assert kept == reaching - set(plants)
    assert "web/fortunes/art/200" in kept  # the 5-word item is too short to be indexed
    rejects = {d["id"]: d for d in _rejects(cfg.output, "decontaminate")}
    assert set(rejects) == set(plants)
    for doc_id, (task, item, _) in plants.items():
        meta = rejects[doc_id]["metadata"]
        assert (meta["contaminated_task"], meta["contaminated_item"], meta["filter_reason"]) == (task, item,
                                                                                               "contaminated")
        gram = meta["contaminated_ngram"]
        assert gram in simplify_text(text[item]) and gram in simplify_text(rejects[doc_id]["text"])
        assert len(gram.split()) == min(13, len(simplify_text(text[item]).split()))
    st = m.sources
    assert (st["web"].stats["decontaminated"], st["docs"].stats["decontaminated"]) == (4, 1)
    assert m.build_stats["decontaminated"] == 5
    assert m.build_stats["decontaminated_by_task"] == {"quiz": 3, "trivia": 2}


def test_index_normalises_and_matches_windows():
    idx = DecontIndex(n=5, min_words=3)
    idx.add("t", "long", "The Quick brown fox, jumps over the lazy dog")
    idx.add("t", "short", "Café au lait")  # 3 words: indexed whole
    idx.add("t", "tiny", "hello there")  # below min_words
    assert idx.skipped["t"] == 1 and idx.indexed["t"] == 2
    assert idx.match("so... FOX JUMPS\nover the LAZY!! cat") == ("t", "long", "fox jumps over the lazy")
    assert idx.match("a cafe AU-LAIT please")[:2] == ("t", "short")
    assert idx.match("fox jumps over the cat lazy dog") is None  # no 5-word window in common
    assert idx.match("hello there") is None and idx.match("") is None
    # the bundled tasks' prompt labels are template, not item text
    q = "Question: Where are you likely to find a hamburger?\nAnswer:"
    item = Item("csqa", "7", [Request(q, " fast food restaurant"), Request(q, " zoo")], 0, question=q)
    assert simplify_text(index_text(item)) == "where are you likely to find a hamburger fast food restaurant"


def test_index_is_built_once_and_bad_tasks_fail_early(built, tmp_path):
    cfg, inputs, _, _, _ = built
    assert load_index(cfg.decontaminate) is load_index(cfg.decontaminate)
    bad = BuildConfig(output=str(tmp_path / "o"), sources=cfg.sources, tokenizer=cfg.tokenizer,
                      decontaminate=DecontaminateConfig(tasks=[f"nope={tmp_path / 'missing.jsonl'}"]))
    with pytest.raises(TaskError, match="missing.jsonl"):
        Build(bad)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_same_split_and_decontamination_with_two_workers(built):
    cfg, _, _, _, root = built
    cfg2 = BuildConfig(**{**cfg.__dict__, "output": str(root / "out2")})
    Build(cfg2, workers=2).run(progress=False)
    a, b = read_manifest(cfg.output), read_manifest(cfg2.output)
    a.build_config.pop("output"), b.build_config.pop("output")
    assert a == b and a.validation
    for info in [*a.sources.values(), *a.validation.values()]:
        for sh in info.shards:
            assert Path(cfg.output, sh.path).read_bytes() == Path(cfg2.output, sh.path).read_bytes()
    assert sorted(d["id"] for d in _rejects(cfg2.output, "decontaminate")) == \
        sorted(d["id"] for d in _rejects(cfg.output, "decontaminate"))
