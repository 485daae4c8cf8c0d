"""Bad input is counted and rejected with file and line; wrong paths and field names fail fast."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from datapipe.config import BuildConfig, NormalizeConfig, SourceConfig, TokenizerConfig
from datapipe.normalize import normalize_text
from datapipe.pipeline import Build
from storage.manifest import read_manifest

OTHER = "An entirely different sentence about rivers, mountains and the weather in the north."
GOOD = "The quick brown fox jumps over the lazy dog, and then it runs back to the forest again."


def _write_bad_file(path: Path) -> None:
    big = "word " * 10_500_000  # ~52 MB of text, over the default max_chars
    with open(path, "wb") as f:
        f.write(json.dumps({"id": "a", "text": GOOD}).encode() + b"\n")            # line 1 ok
        f.write(b'{"id": "b", "text": "unterminated\n')                             # line 2 malformed
        f.write(b'{"id": "c", "text": "caf\xe9 latin-1 bytes"}\n')                # line 3 not UTF-8
        f.write(json.dumps({"id": "d", "body": GOOD}).encode() + b"\n")            # line 4 missing field
        f.write(json.dumps({"id": "e", "text": "   \n\t "}).encode() + b"\n")      # line 5 empty
        f.write(json.dumps({"id": "f", "text": big}).encode() + b"\n")             # line 6 50 MB
        f.write(json.dumps({"id": "g", "text": 42}).encode() + b"\n")              # line 7 not a string
        f.write(json.dumps({"id": "h", "text": OTHER}).encode() + b"\n")  # line 8 ok


@pytest.mark.slow
def test_bad_records_are_rejected_with_file_and_line(tmp_path, small_tokenizer):
    src = tmp_path / "bad.jsonl"
    _write_bad_file(src)
    cfg = BuildConfig(output=str(tmp_path / "out"), sources=[SourceConfig("s", [str(src)], filters=[])],
                      tokenizer=TokenizerConfig(path=small_tokenizer))
    Build(cfg).run(progress=False)
    m = read_manifest(cfg.output)
    st = m.sources["s"].stats
    assert st["read"] == 8 and st["dropped_read"] == 6 and m.sources["s"].documents == 2
    rejects = []
    with gzip.open(tmp_path / "out" / "rejects" / "read" / "00000.jsonl.gz", "rt") as f:
        for line in f:
            rejects.append(json.loads(line)["metadata"])
    by_line = {r["line"]: r for r in rejects}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7]
    assert all(r["file"] == str(src) and r["filter"] == "read" for r in rejects)
    assert "malformed JSON" in by_line[2]["filter_reason"]
    assert "not UTF-8" in by_line[3]["filter_reason"]
    assert "missing text field 'text'" in by_line[4]["filter_reason"]
    assert by_line[5]["filter_reason"] == "empty document"
    assert "max_chars" in by_line[6]["filter_reason"]
    assert "not a string" in by_line[7]["filter_reason"]


def test_unreadable_path_fails_fast_naming_it(tmp_path):
    cfg = BuildConfig(output=str(tmp_path / "out"), sources=[SourceConfig("s", [str(tmp_path / "nope*.jsonl")])])
    with pytest.raises(FileNotFoundError, match="nope\\*.jsonl"):
        Build(cfg)


def test_wrong_field_name_fails_fast(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps({"id": i, "content": GOOD}) + "\n" for i in range(5)))
    cfg = BuildConfig(output=str(tmp_path / "out"), sources=[SourceConfig("s", [str(p)], text_field="text")])
    with pytest.raises(KeyError, match="text field 'text' not found.*a.jsonl.*content"):
        Build(cfg)


def test_normalize_nfc_controls_whitespace():
    cfg = NormalizeConfig()
    assert normalize_text("Cafe\u0301\r\nA\x00B\u00a0C  \n\n\n\nD\ufeff", cfg) == "Caf\u00e9\nAB C\n\nD"
    assert normalize_text("  \x07 ", cfg) == ""


def test_reads_parquet_zstd_jsonl_and_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from datapipe.inputs import expand_sources
    from datapipe.sources import SourceReader

    pq.write_table(pa.table({"content": [GOOD, OTHER], "uid": ["p1", "p2"]}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        (json.dumps({"id": "z1", "content": GOOD}) + "\n").encode()))
    (tmp_path / "c.txt").write_text(OTHER)
    srcs = [SourceConfig("pq", [str(tmp_path / "a.parquet")], text_field="content", id_field="uid"),
            SourceConfig("zs", [str(tmp_path / "*.zst")], text_field="content"),
            SourceConfig("tx", [str(tmp_path / "c.txt")])]
    files = expand_sources(srcs)
    assert [(f.source, f.fmt) for f in files] == [("pq", "parquet"), ("zs", "jsonl"), ("tx", "text")]
    reader = SourceReader(files, {s.name: s for s in srcs}, str(tmp_path / "rejects"), max_chars=10**6)
    got = [(d.id, d.text) for r in range(3) for d in reader.run(rank=r)]
    assert got == [("pq/p1", GOOD), ("pq/p2", OTHER), ("zs/z1", GOOD), ("tx/c.txt", OTHER)]
