"""End-to-end `datapipe build` on real corpora subsets: accounting, dedup, decoding, determinism."""
from __future__ import annotations

import filecmp
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
from testutil import read_corpus, write_jsonl

from datapipe.config import BuildConfig, FilterSpec, ShardsConfig, SourceConfig, TokenizerConfig
from datapipe.pipeline import Build
from datapipe.tokenize import load_tokenizer
from storage.dataset import Dataset
from storage.manifest import read_manifest
from storage.shards import iter_shard


def make_inputs(root: Path) -> dict[str, list[str]]:
    lic = read_corpus("licenses")
    fortunes = read_corpus("fortunes", 1200)
    pydoc = read_corpus("pydoc", 120)
    # three license texts copied verbatim into web: exact duplicates across sources (lic has priority)
    web = fortunes[:600] + [{"id": f"copy-{d['id']}", "text": d["text"]} for d in lic[:3]] + fortunes[600:]
    return {
        "lic": [write_jsonl(root / "lic" / "licenses.jsonl", lic)],
        "docs": [write_jsonl(root / "docs" / "pydoc.jsonl", pydoc)],
        "web": [write_jsonl(root / "web" / "a.jsonl", web[:700]), write_jsonl(root / "web" / "b.jsonl", web[700:])],
    }


def make_config(inputs: dict[str, list[str]], out: Path, tokenizer: str) -> BuildConfig:
    return BuildConfig(
        output=str(out),
        sources=[SourceConfig("lic", inputs["lic"], filters=[]),
                 SourceConfig("docs", inputs["docs"]),  # FineWeb's default chain
                 SourceConfig("web", [str(Path(inputs["web"][0]).parent / "*.jsonl")],
                              filters=[FilterSpec("gopher_quality", {"min_doc_words": 5, "min_stop_words": 0})])],
        tokenizer=TokenizerConfig(path=tokenizer),
        shards=ShardsConfig(block_tokens=8192, shard_blocks=4),
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_tokenizer):
    root = tmp_path_factory.mktemp("build")
    inputs = make_inputs(root / "in")
    cfg = make_config(inputs, root / "out", small_tokenizer)
    Build(cfg).run(progress=False)
    return cfg, inputs, root


def _jsonl(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def _rejects(out: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in sorted(Path(out, "rejects").rglob("*.jsonl.gz")):
        with gzip.open(p, "rt") as f:
            for line in f:
                d = json.loads(line)
                key = d["metadata"].get("filter") or p.parent.name
                counts[p.parent.name] = counts.get(p.parent.name, 0) + 1
                assert key
    return counts


def test_every_document_is_in_a_shard_or_in_rejects(built):
    cfg, inputs, _ = built
    m = read_manifest(cfg.output)
    for name, src in m.sources.items():
        st = src.stats
        dropped = sum(v for k, v in st.items() if k.startswith("dropped_") and ":" not in k)
        assert st["read"] == dropped + st["exact_duplicates"] + st["near_duplicates"] + st["decontaminated"] + \
            src.documents + st["validation_documents"], (name, st)
    n_in = sum(len(Path(p).read_text().splitlines()) for ps in inputs.values() for p in ps)
    assert m.build_stats["read"] == n_in
    rejects = _rejects(cfg.output)
    filter_drops = sum(v for k, v in m.build_stats.items() if k.startswith("dropped_") and ":" not in k)
    assert sum(rejects.values()) == filter_drops + m.build_stats["exact_duplicates"] + m.build_stats["near_duplicates"]
    assert rejects.get("exact_dup", 0) == m.build_stats["exact_duplicates"]
    assert rejects.get("near_dup", 0) == m.build_stats["near_duplicates"]


def test_exact_duplicates_kept_in_highest_priority_source(built):
    cfg, _, _ = built
    m = read_manifest(cfg.output)
    assert m.sources["lic"].stats["exact_duplicates"] == 0
    assert m.sources["web"].stats["exact_duplicates"] >= 3
    clusters = _jsonl(os.path.join(cfg.output, "dedup", "exact_clusters.jsonl"))
    lic_kept = [c for c in clusters if c["kept"].startswith("lic/")]
    assert len(lic_kept) == 3 and all(r[0].startswith("web/copy-") for r in (c["removed"] for c in lic_kept))


def test_license_pairs_near_dedup(built):
    cfg, _, _ = built
    ids = {i for b in Dataset.open(cfg.output).readers["lic"] for k in range(len(b)) for i in b.read_block(k).doc_ids}
    assert "lic/licenses/GFDL-1.2" in ids and "lic/licenses/GFDL-1.3" not in ids  # Jaccard ~0.85: collapsed, first kept
    assert "lic/licenses/GPL-2" in ids and "lic/licenses/LGPL-2" in ids  # ~0.37: both stay
    clusters = _jsonl(os.path.join(cfg.output, "dedup", "near_dup_clusters.jsonl"))
    assert {"kept": "lic/licenses/GFDL-1.2", "removed": ["lic/licenses/GFDL-1.3"]} in clusters


def test_decoded_shards_give_back_kept_texts(built):
    cfg, _, root = built
    kept = {}
    for p in sorted(Path(root, "out", "_work", "deduped").glob("*.jsonl")):
        for d in _jsonl(p):
            kept[d["id"]] = d["text"]
    m = read_manifest(cfg.output)
    tok = load_tokenizer(os.path.join(cfg.output, "tokenizer.json"))
    seen = 0
    for src in m.sources.values():
        for sh in src.shards:
            for blk in iter_shard(os.path.join(cfg.output, sh.path), expected_sha256=sh.sha256):
                for i, doc_id in enumerate(blk.doc_ids):
                    toks = blk.tokens[blk.offsets[i]:blk.offsets[i + 1]]
                    assert toks[-1] == m.tokenizer.eos_id
                    assert tok.decode(toks[:-1].tolist(), skip_special_tokens=False) == kept[doc_id]
                    seen += 1
    assert seen == sum(s.documents for s in m.sources.values()) > 0


def test_mix_and_manifest(built):
    cfg, _, _ = built
    m = read_manifest(cfg.output)
    assert len(m.mix) == 1 and m.mix[0].tokens == m.total_tokens
    assert m.tokenizer.dtype == "uint16" and m.tokenizer.vocab_size <= 1024
    assert m.build_config["sources"][0]["name"] == "lic"
    assert os.path.exists(os.path.join(cfg.output, "build_config.yaml"))


@pytest.mark.slow
def test_same_output_with_two_workers(built):
    cfg, _, root = built
    cfg2 = BuildConfig(**{**cfg.__dict__, "output": str(root / "out2")})
    Build(cfg2, workers=2).run(progress=False)
    a, b = read_manifest(cfg.output), read_manifest(cfg2.output)
    for name in a.sources:
        assert [s.sha256 for s in a.sources[name].shards] == [s.sha256 for s in b.sources[name].shards]
        for s in a.sources[name].shards:
            assert filecmp.cmp(os.path.join(cfg.output, s.path), os.path.join(cfg2.output, s.path), shallow=False)
    a.build_config.pop("output"), b.build_config.pop("output")
    assert a == b


def test_block_sizes_follow_config(built):
    cfg, _, _ = built
    m = read_manifest(cfg.output)
    ds = Dataset.open(cfg.output)
    for name, readers in ds.readers.items():
        for r, sh in zip(readers, m.sources[name].shards):
            assert len(r) == sh.blocks <= 4
            lens = [len(r.read_block(k).tokens) for k in range(len(r))]
            assert all(n >= 1 for n in lens)
            # only a block holding a single over-long document may exceed the target
            for k, n in enumerate(lens):
                if n > 8192:
                    assert len(r.read_block(k).doc_ids) == 1
    assert np.sum([s.tokens for s in m.sources.values()]) == m.total_tokens
