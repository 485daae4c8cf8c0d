"""Hugging Face dataset folders as sources: a `datasets` save_to_disk folder and a Hub-style Parquet folder
build the same shards, counts and rejects as the same rows in JSONL; folder layouts (DatasetDict splits,
subsets, state.json's file order) resolve as the Hub lays them out; an s3:// folder reads like a local one."""
from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pytest
from testutil import read_corpus, write_jsonl

from datapipe.config import BuildConfig, FilterSpec, ShardsConfig, SourceConfig, TokenizerConfig
from datapipe.inputs import expand_sources
from datapipe.pipeline import Build
from datapipe.sources import SourceReader
from storage import config as cfgmod
from storage.config import ConfigError
from storage.manifest import read_manifest

GOOD = "The quick brown fox jumps over the lazy dog, and then it runs back to the forest again."
NO_TEXT = 7  # the 0-based row of the record without a text field (in the first file)


def _rows() -> list[dict]:
    rows = [{"id": d["id"], "text": d["text"]} for d in read_corpus("fortunes", 80)]
    rows[NO_TEXT] = {"id": "no-text"}  # JSONL: no key; Arrow / Parquet: null
    rows[20] = {"id": "empty", "text": "  \n "}
    rows[30] = {"id": "orig", "text": GOOD}
    rows[60] = {"id": "dup", "text": GOOD}  # an exact duplicate in the other file
    return rows


def _halves(rows: list[dict]) -> list[list[dict]]:
    """The rows of save_to_disk(num_shards=2)'s two files (datasets' contiguous shards)."""
    import datasets

    ds = datasets.Dataset.from_list(rows)
    return [ds.shard(2, k, contiguous=True).to_list() for k in range(2)]


def _build(out: Path, src: SourceConfig, tok: str) -> str:
    src.filters = [FilterSpec("gopher_quality", {"min_doc_words": 5, "min_stop_words": 0})]  # keeps most fortunes
    cfg = BuildConfig(output=str(out), sources=[src], tokenizer=TokenizerConfig(path=tok),
                      shards=ShardsConfig(block_tokens=2048, shard_blocks=2))
    cfg.validation.fraction = 0.1
    Build(cfg).run(progress=False)
    return cfg.output


def _read_rejects(out: str) -> list[dict]:
    recs = []
    for p in sorted(Path(out, "rejects", "read").glob("*.jsonl.gz")):
        with gzip.open(p, "rt") as f:
            recs += [json.loads(line) for line in f]
    return recs


def _shard_files(out: str) -> dict[str, bytes]:
    """Every shard and index file of the dataset (training and held out), by path."""
    root = Path(out)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("shard-*"))}


@pytest.fixture(scope="module")
def jsonl_build(tmp_path_factory, small_tokenizer):
    """The rows as JSONL, in two files holding what the two Arrow files hold (shards are written per task,
    one task per file in both), built once for the tests below to compare with."""
    root = tmp_path_factory.mktemp("hf")
    rows = _rows()
    for k, half in enumerate(_halves(rows)):
        write_jsonl(root / "jsonl" / f"part-{k}.jsonl", [{c: v for c, v in r.items() if v is not None} for r in half])
    out = _build(root / "out-jsonl", SourceConfig("web", [str(root / "jsonl" / "*.jsonl")]), small_tokenizer)
    return root, rows, out


def _assert_same_dataset(out: str, ref: str, first_file: str) -> None:
    a, b = read_manifest(out), read_manifest(ref)
    assert a.sources["web"].stats == b.sources["web"].stats
    st = a.sources["web"].stats
    assert st["read"] == 80 and st["dropped_read"] == 2 and st["exact_duplicates"] == 1, st
    assert a.validation["web"].documents > 0
    got, want = _shard_files(out), _shard_files(ref)
    assert got == want and len(got) >= 4
    rejects, ref_rejects = _read_rejects(out), _read_rejects(ref)
    assert [(r["id"], r["metadata"]["filter_reason"]) for r in rejects] == \
        [(r["id"], r["metadata"]["filter_reason"]) for r in ref_rejects]
    no_text = next(r["metadata"] for r in rejects if r["id"] == "web/no-text")
    assert no_text["file"] == first_file and no_text["row"] == NO_TEXT + 1
    assert no_text["filter_reason"].startswith("missing text field 'text'")
    ref_no_text = next(r["metadata"] for r in ref_rejects if r["id"] == "web/no-text")
    assert ref_no_text["line"] == NO_TEXT + 1 and ref_no_text["filter_reason"] == no_text["filter_reason"]


def test_save_to_disk_folder_builds_the_shards_of_the_same_jsonl(jsonl_build, small_tokenizer):
    import datasets

    root, rows, ref = jsonl_build
    folder = root / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder), num_shards=2)
    out = _build(root / "out-saved", SourceConfig("web", [str(folder)]), small_tokenizer)  # format: auto
    _assert_same_dataset(out, ref, str(folder / "data-00000-of-00002.arrow"))


def test_hub_parquet_folder_builds_the_shards_of_the_same_jsonl(jsonl_build, small_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, rows, ref = jsonl_build
    hub = root / "hub"
    (hub / "data").mkdir(parents=True)
    for k, half in enumerate(_halves(rows)):
        pq.write_table(pa.table({"id": [r["id"] for r in half], "text": [r["text"] for r in half]}),
                       hub / "data" / f"train-{k:05d}-of-00002.parquet", row_group_size=16)
    other = pa.table({"id": ["t1"], "text": ["A test split row that must not be read into the train split."]})
    pq.write_table(other, hub / "data" / "test-00000-of-00001.parquet")
    out = _build(root / "out-hub", SourceConfig("web", [str(hub)], split="train"), small_tokenizer)
    _assert_same_dataset(out, ref, str(hub / "data" / "train-00000-of-00002.parquet"))


def _write_parquet(path: Path, ids: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "text": [f"text of {i}" for i in ids]}), path)


def _files(src: SourceConfig) -> list[tuple[str, str]]:
    return [(os.path.relpath(f.url, src.paths[0]), f.fmt) for f in expand_sources([src])]


def test_folder_layouts_splits_subsets_and_file_order(tmp_path):
    import datasets

    hub = tmp_path / "hub"
    _write_parquet(hub / "en" / "train-00000-of-00001.parquet", ["e"])  # push_to_hub(config_name="en")
    _write_parquet(hub / "fr" / "train" / "0000.parquet", ["f"])  # the Hub's Parquet conversion
    _write_parquet(hub / "fr" / "train_sft-00000-of-00001.parquet", ["s"])  # another split, same prefix
    _write_parquet(hub / "fr" / "test" / "0000.parquet", ["t"])
    assert _files(SourceConfig("s", [str(hub)], subset="en")) == [("en/train-00000-of-00001.parquet", "parquet")]
    assert _files(SourceConfig("s", [str(hub)], format="hub_parquet", subset="fr")) == \
        [("fr/train/0000.parquet", "parquet")]
    assert _files(SourceConfig("s", [str(hub)], subset="fr", split="train_sft")) == \
        [("fr/train_sft-00000-of-00001.parquet", "parquet")]
    with pytest.raises(ConfigError, match=r"key 'split': 'dev' .*splits there: test, train, train_sft"):
        expand_sources([SourceConfig("s", [str(hub)], subset="fr", split="dev")])
    with pytest.raises(ConfigError, match=r"key 'subset': .*hub has no data/ folder.*folders: en, fr"):
        expand_sources([SourceConfig("s", [str(hub)], format="hub_parquet")])
    with pytest.raises(ConfigError, match=r"key 'subset': .*hub has no folder 'de' \(folders: en, fr\)"):
        expand_sources([SourceConfig("s", [str(hub)], subset="de", format="hub_parquet")])

    rows = [{"id": str(i), "text": f"row {i}"} for i in range(6)]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])})
    dd.save_to_disk(str(tmp_path / "dd"), num_shards={"train": 3, "test": 1})
    state = tmp_path / "dd" / "train" / "state.json"
    st = json.loads(state.read_text())
    st["_data_files"] = st["_data_files"][::-1]  # the order state.json gives, not the names' order
    state.write_text(json.dumps(st))
    assert _files(SourceConfig("s", [str(tmp_path / "dd")])) == \
        [(f"train/data-0000{k}-of-00003.arrow", "arrow") for k in (2, 1, 0)]
    assert _files(SourceConfig("s", [str(tmp_path / "dd")], split="test")) == [("test/data-00000-of-00001.arrow", "arrow")]
    with pytest.raises(ConfigError, match=r"key 'split': 'dev' is not a split of .*dd \(splits: train, test\)"):
        expand_sources([SourceConfig("s", [str(tmp_path / "dd")], split="dev")])
    with pytest.raises(KeyError, match=r"text field 'body' is not a column of .*data-00002-of-00003.arrow"):
        expand_sources([SourceConfig("s", [str(tmp_path / "dd")], text_field="body")])

    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="folder with neither a datasets save_to_disk layout"):
        expand_sources([SourceConfig("s", [str(tmp_path / "plain")])])
    with pytest.raises(FileNotFoundError, match="format save_to_disk reads a folder.*0000.parquet"):
        expand_sources([SourceConfig("s", [str(hub / "fr" / "test" / "0000.parquet")], format="save_to_disk")])


def test_config_errors_name_the_key_and_the_file(tmp_path):
    for body, key in (("sources: [{name: s, paths: [x], split: 'a/b'}]", "'split'"),
                      ("sources: [{name: s, paths: [x], format: jsonl, subset: en}]", "'subset'"),
                      ("card: {license: Apache 2.0}", "'card.license'")):
        path = tmp_path / "b.yaml"
        path.write_text(body + "\n")
        with pytest.raises(ConfigError, match=f"{re.escape(str(path))}.*key {key}"):
            cfgmod.load(BuildConfig, path)


def test_save_to_disk_folder_on_s3_reads_as_local(s3_bucket, tmp_path):
    import datasets
    import s3fs

    rows = [{"id": str(i), "text": f"row {i} of the saved dataset"} for i in range(5)] + [{"id": "x"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    s3fs.S3FileSystem().put(str(tmp_path / "saved"), f"{s3_bucket}/saved", recursive=True)
    got = {}
    for where in (str(tmp_path / "saved"), f"{s3_bucket}/saved"):
        src = SourceConfig("s", [where])
        files = expand_sources([src])
        reader = SourceReader(files, {"s": src}, str(tmp_path / f"rejects-{len(got)}"), max_chars=10**6)
        got[where] = [(f.url.rsplit("/", 1)[1], d.id, d.text) for r, f in enumerate(files) for d in reader.run(rank=r)]
    local, remote = got.values()
    assert local == remote and len(local) == 5 and local[0] == ("data-00000-of-00002.arrow", "s/0", rows[0]["text"])
