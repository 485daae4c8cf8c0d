"""Shard format v1: round trips, stock tools, webdataset, range reads, corruption, atomic writes."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import fs
from storage.dataset import Dataset
from storage.shard_writer import ShardWriter
from storage.shards import ShardError, ShardReader, iter_shard, scan_index

from testutil import REPO, require_tool, write_random_dataset


def _docs(rng, n, vocab):
    return [rng.integers(0, vocab, int(rng.integers(1, 400))) for _ in range(n)]


def _write(path, blocks, dtype, source="web"):
    with ShardWriter(str(path), dtype, source) as w:
        for b in blocks:
            offsets = np.concatenate([[0], np.cumsum([len(d) for d in b])]).tolist()
            w.add_block(np.concatenate(b), [f"d{i}" for i in range(len(b))], offsets)
    return w


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_blocks=st.integers(1, 6), wide=st.booleans())
def test_round_trip_both_dtypes(tmp_path_factory, seed, n_blocks, wide):
    rng = np.random.default_rng(seed)
    vocab, dtype = (200_000, "uint32") if wide else (65_536, "uint16")
    blocks = [_docs(rng, int(rng.integers(1, 5)), vocab) for _ in range(n_blocks)]
    path = tmp_path_factory.mktemp("rt") / "shard-000000.tar"
    _write(path, blocks, dtype)
    got = list(iter_shard(str(path)))
    reader = ShardReader(str(path))
    assert len(got) == len(reader) == n_blocks
    for k, (b, want) in enumerate(zip(got, blocks)):
        assert b.tokens.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(b.tokens, np.concatenate(want))
        np.testing.assert_array_equal(reader.read_block(k).tokens, b.tokens)  # range read == sequential
        assert b.offsets[-1] == len(b.tokens) and len(b.offsets) == len(want) + 1


def test_uint16_rejects_out_of_range_ids(tmp_path):
    with pytest.raises(ValueError, match="out of range for uint16"):
        _write(tmp_path / "s.tar", [[np.array([70_000])]], "uint16")
    assert not os.listdir(tmp_path), "an aborted write must leave nothing behind"


@pytest.fixture
def shard(tmp_path):
    rng = np.random.default_rng(7)
    blocks = [_docs(rng, 3, 50_000) for _ in range(4)]
    path = tmp_path / "shard-000000.tar"
    w = _write(path, blocks, "uint16")
    return path, blocks, w


def test_stock_tar_lists_shard(shard):
    path, blocks, _ = shard
    out = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True, check=True).stdout.split()
    assert out == [f"shard-000000_{k:06d}.{ext}" for k in range(len(blocks)) for ext in ("tokens.lz4", "json")]


def test_stock_lz4_decodes_member(shard, tmp_path):
    require_tool("lz4")
    path, blocks, _ = shard
    with tarfile.open(path) as tar:
        payload = tar.extractfile("shard-000000_000002.tokens.lz4").read()
    (tmp_path / "m.lz4").write_bytes(payload)
    raw = subprocess.run(["lz4", "-dc", str(tmp_path / "m.lz4")], capture_output=True, check=True).stdout
    assert raw == np.concatenate(blocks[2]).astype("<u2").tobytes()


def test_webdataset_reads_every_sample(shard):
    import json

    import webdataset as wds

    path, blocks, _ = shard
    samples = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"shard-000000_{k:06d}" for k in range(len(blocks))]
    for s, want in zip(samples, blocks):
        import lz4.frame

        np.testing.assert_array_equal(np.frombuffer(lz4.frame.decompress(s["tokens.lz4"]), "<u2"),
                                      np.concatenate(want))
        assert json.loads(s["json"])["offsets"][-1] == sum(len(d) for d in want)


def test_index_matches_scan_and_dali_layout(shard):
    path, _, w = shard
    assert scan_index(str(path)) == ShardReader(str(path)).index
    lines = (path.parent / (path.name + ".idx")).read_text().splitlines()
    assert lines[0] == "v1.2 4"
    ext, off, size, name = lines[1].split()[:4]
    assert (ext, name) == ("tokens.lz4", "shard-000000_000000.tokens.lz4") and int(off) % 512 == 0


def test_deterministic_bytes(tmp_path):
    rng = np.random.default_rng(3)
    blocks = [_docs(rng, 2, 1000) for _ in range(3)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _write(tmp_path / "a" / "s.tar", blocks, "uint16")
    b = _write(tmp_path / "b" / "s.tar", blocks, "uint16")
    assert (tmp_path / "a" / "s.tar").read_bytes() == (tmp_path / "b" / "s.tar").read_bytes()
    assert a.entries == b.entries


# ---- corruption: each kind gives a clear error naming the shard ------------------------------------------

def _err(fn) -> str:
    with pytest.raises(ShardError) as ei:
        fn()
    return str(ei.value)


def test_truncated_tar(shard):
    path, _, _ = shard
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])
    msg = _err(lambda: list(iter_shard(str(path))))
    assert str(path) in msg and "truncated" in msg
    msg = _err(lambda: ShardReader(str(path)).read_block(3))
    assert str(path) in msg and "beyond the end" in msg


def test_flipped_byte_in_lz4_frame(shard):
    path, _, w = shard
    e = w.entries[1]
    data = bytearray(path.read_bytes())
    data[e.tokens_offset + 512 + e.tokens_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    for fn in (lambda: list(iter_shard(str(path))), lambda: ShardReader(str(path)).read_block(1)):
        msg = _err(fn)
        assert str(path) in msg and "shard-000000_000001.tokens.lz4" in msg and f"offset {e.tokens_offset}" in msg


def test_wrong_sha256(shard):
    path, _, _ = shard
    msg = _err(lambda: list(iter_shard(str(path), expected_sha256="0" * 64)))
    assert str(path) in msg and "sha256 mismatch" in msg


def _tar_with(path, members):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)


def _ti(name, size=0, type_=tarfile.REGTYPE, linkname=""):
    ti = tarfile.TarInfo(name)
    ti.size, ti.type, ti.linkname = size, type_, linkname
    return ti


def test_missing_member(tmp_path):
    import lz4.frame

    payload = lz4.frame.compress(np.arange(5, dtype="<u2").tobytes())
    path = tmp_path / "s.tar"
    _tar_with(path, [(_ti("a_000000.tokens.lz4", len(payload)), payload)])
    msg = _err(lambda: list(iter_shard(str(path))))
    assert str(path) in msg and "missing its json member" in msg


@pytest.mark.parametrize("name,type_,linkname,expect", [
    ("../evil.json", tarfile.REGTYPE, "", "path traversal"),
    ("/etc/evil.json", tarfile.REGTYPE, "", "absolute path"),
    ("a_000000.json", tarfile.SYMTYPE, "/etc/passwd", "symlink"),
    ("a_000000.json", tarfile.LNKTYPE, "x", "hard link"),
    ("a_000000.json", tarfile.CHRTYPE, "", "character device"),
])
def test_unsafe_members(tmp_path, name, type_, linkname, expect):
    path = tmp_path / "s.tar"
    _tar_with(path, [(_ti(name, 2 if type_ == tarfile.REGTYPE else 0, type_, linkname),
                      b"{}" if type_ == tarfile.REGTYPE else None)])
    msg = _err(lambda: list(iter_shard(str(path))))
    assert str(path) in msg and "unsafe member" in msg and expect in msg and name in msg


def test_empty_shard(tmp_path):
    path = tmp_path / "s.tar"
    _tar_with(path, [])
    msg = _err(lambda: list(iter_shard(str(path))))
    assert str(path) in msg and "empty shard" in msg


def test_index_header_mismatch_detected(shard):
    path, _, _ = shard
    idx = path.parent / (path.name + ".idx")
    lines = idx.read_text().splitlines()
    a, b = lines[1].split(), lines[2].split()
    lines[1] = " ".join(b[:4] + a[4:])  # block 0's tokens entry now points at block 1's member
    idx.write_text("\n".join(lines) + "\n")
    msg = _err(lambda: ShardReader(str(path)).read_block(0))
    assert "index says shard-000000_000001.tokens.lz4" in msg or "tar header says" in msg


def test_interrupted_write_leaves_no_final_file(tmp_path):
    """A writer killed mid-write (SIGKILL) leaves only a hidden temp file, never a final name."""
    target = tmp_path / "shard-000000.tar"
    code = textwrap.dedent(f"""
        import sys, time, numpy as np
        sys.path.insert(0, {str(REPO)!r})
        from storage.shard_writer import ShardWriter
        w = ShardWriter({str(target)!r}, "uint16", "web")
        rng = np.random.default_rng(0)
        for i in range(10**6):
            w.add_block(rng.integers(0, 60000, 5000), ["d"], [0, 5000])
            if i == 3:
                print("writing", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = os.listdir(tmp_path)
    assert names and all(n.startswith(".tmp-") for n in names), names
    assert not target.exists() and not (tmp_path / "shard-000000.tar.idx").exists()


def test_dataset_on_s3(tmp_path, s3_bucket):
    """Write a dataset straight to s3:// (moto) and range-read blocks back through fsspec."""
    url = f"{s3_bucket}/ds"
    m = write_random_dataset(url, {"web": 30}, block_tokens=1024, shard_blocks=2)
    ds = Dataset.open(url)
    assert ds.manifest.sources["web"].tokens == m.sources["web"].tokens
    first = ds.readers["web"][0]
    seq = list(iter_shard(first.url, m.sources["web"].shards[0].sha256))
    for k, b in enumerate(seq):
        np.testing.assert_array_equal(first.read_block(k).tokens, b.tokens)
    assert fs.exists(fs.join(url, "manifest.json"))
