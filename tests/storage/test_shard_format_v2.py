"""Shard format v2 (blocks with a loss mask): round trips, index, stock tools, webdataset, corruption,
and format 1 data and manifests still loading."""
from __future__ import annotations

import json
import subprocess
import tarfile

import lz4.frame
import numpy as np
import pytest

from storage.dataset import Dataset, SourceWriter, iter_documents
from storage.manifest import Manifest, TokenizerInfo, read_manifest, write_manifest
from storage.shard_writer import ShardWriter
from storage.shards import ShardError, ShardReader, decode_mask, iter_shard, parse_index, scan_index
from storage.config import ConfigError

from testutil import require_tool, write_random_dataset

KEY = "shard-000000_{:06d}"


def _blocks(seed: int = 0, n: int = 4):
    """Blocks of (tokens, mask or None): every other block has a mask."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        sizes = rng.integers(1, 300, 3)
        toks = rng.integers(0, 50_000, int(sizes.sum()))
        mask = rng.integers(0, 2, len(toks)).astype(np.uint8) if k % 2 == 0 else None
        out.append((toks, sizes, mask))
    return out


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "shard-000000.tar"
    blocks = _blocks()
    with ShardWriter(str(path), "uint16", "chat") as w:
        for toks, sizes, mask in blocks:
            w.add_block(toks, [f"d{i}" for i in range(len(sizes))], [0, *np.cumsum(sizes).tolist()], mask)
    return path, blocks


def test_round_trip_and_index(shard):
    path, blocks = shard
    reader = ShardReader(str(path))
    seq = list(iter_shard(str(path)))
    assert len(seq) == len(reader) == len(blocks)
    for k, (toks, _, mask) in enumerate(blocks):
        for b in (seq[k], reader.read_block(k)):
            np.testing.assert_array_equal(b.tokens, toks)
            if mask is None:
                assert b.mask is None
            else:
                assert b.mask.dtype == np.uint8
                np.testing.assert_array_equal(b.mask, mask)
    assert scan_index(str(path)) == reader.index
    idx = (path.parent / (path.name + ".idx")).read_text().splitlines()
    assert idx[1].split()[8:] and idx[1].split()[8] == "mask.lz4" and len(idx[2].split()) == 8
    assert reader.index[0].mask_offset > reader.index[0].meta_offset and reader.index[1].mask_offset == -1
    # the loader's fast path: mask from the raw members
    payload, meta, mask_raw = reader.read_members(0)
    np.testing.assert_array_equal(decode_mask(str(path), reader.index[0].key, mask_raw, meta, 0), blocks[0][2])
    assert json.loads(bytes(meta))["format"] == 2 and json.loads(bytes(reader.read_raw(1)[1]))["format"] == 1


def test_stock_tar_lz4_and_webdataset(shard, tmp_path):
    path, blocks = shard
    names = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True, check=True).stdout.split()
    want = []
    for k, (_, _, mask) in enumerate(blocks):
        want += [f"{KEY.format(k)}.tokens.lz4", f"{KEY.format(k)}.json"] + ([f"{KEY.format(k)}.mask.lz4"] * (mask is not None))
    assert names == want
    require_tool("lz4")
    with tarfile.open(path) as tar:
        (tmp_path / "m.lz4").write_bytes(tar.extractfile(f"{KEY.format(2)}.mask.lz4").read())
    raw = subprocess.run(["lz4", "-dc", str(tmp_path / "m.lz4")], capture_output=True, check=True).stdout
    assert raw == blocks[2][2].tobytes()
    import webdataset as wds

    samples = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in samples] == [KEY.format(k) for k in range(len(blocks))]
    for s, (toks, _, mask) in zip(samples, blocks):
        np.testing.assert_array_equal(np.frombuffer(lz4.frame.decompress(s["tokens.lz4"]), "<u2"), toks)
        if mask is None:
            assert "mask.lz4" not in s
        else:
            np.testing.assert_array_equal(np.frombuffer(lz4.frame.decompress(s["mask.lz4"]), np.uint8), mask)


def _mask_data_offset(path, k: int) -> int:
    e = ShardReader(str(path)).index[k]
    return e.mask_offset + 512


def test_corrupt_mask_names_the_member(shard):
    path, _ = shard
    data = bytearray(path.read_bytes())
    data[_mask_data_offset(path, 2) + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    member = f"{KEY.format(2)}.mask.lz4"
    for fn in (lambda: ShardReader(str(path)).read_block(2), lambda: list(iter_shard(str(path)))):
        with pytest.raises(ShardError) as ei:
            fn()
        assert ei.value.member == member and str(path) in str(ei.value) and "checksum" in str(ei.value)
    ShardReader(str(path)).read_block(1)  # other blocks still read


def test_mask_member_missing_or_unnamed(tmp_path, shard):
    path, _ = shard
    idx = parse_index((path.parent / (path.name + ".idx")).read_text(), str(path))
    e = idx[0]
    # an index without the mask component: the JSON still names a mask, so the block is refused
    from dataclasses import replace

    reader = ShardReader(str(path), [replace(e, mask_offset=-1, mask_size=0)])
    with pytest.raises(ShardError, match="no mask.lz4 member"):
        reader.read_block(0)


def test_writer_rejects_bad_masks(tmp_path):
    with pytest.raises(ValueError, match="one entry per token"):
        with ShardWriter(str(tmp_path / "s.tar"), "uint16", "x") as w:
            w.add_block(np.arange(5), ["a"], [0, 5], np.ones(4, np.uint8))
    with pytest.raises(ValueError, match="0 or 1"):
        with ShardWriter(str(tmp_path / "s.tar"), "uint16", "x") as w:
            w.add_block(np.arange(5), ["a"], [0, 5], np.full(5, 2, np.uint8))


def test_source_writer_dataset_and_manifest(tmp_path):
    root = str(tmp_path / "ds")
    rng = np.random.default_rng(1)
    docs = [(f"c{i}", rng.integers(0, 1000, int(rng.integers(5, 80))).astype(np.uint16)) for i in range(40)]
    masks = [rng.integers(0, 2, len(t)).astype(np.uint8) for _, t in docs]
    w = SourceWriter(root, "chat", "uint16", block_tokens=300, shard_blocks=3)
    for (i, t), m in zip(docs, masks):
        w.add_document(i, t, m)
    info = w.close()
    assert info.kind == "chat" and len(info.shards) > 1
    with pytest.raises(ValueError, match="all have a loss mask or none"):
        w2 = SourceWriter(root, "mixed", "uint16")
        w2.add_document("a", np.arange(3), np.ones(3, np.uint8))
        w2.add_document("b", np.arange(3))
    m = Manifest(TokenizerInfo("t.json", "0" * 64, 1000, 0, "uint16"), {"chat": info}, chat_template="{{ x }}")
    with pytest.raises(ConfigError, match="need format_version 2"):
        write_manifest(root, m)
    m.format_version = m.needed_version()
    write_manifest(root, m)
    back = read_manifest(root)
    assert back.format_version == 2 and back.sources["chat"].kind == "chat" and back.chat_template == "{{ x }}"
    got = list(iter_documents(root, back.sources["chat"].shards, with_mask=True))
    assert [g[0] for g in got] == [d[0] for d in docs]
    for (_, t, gm), (_, want_t), want_m in zip(got, docs, masks):
        np.testing.assert_array_equal(t, want_t)
        np.testing.assert_array_equal(gm, want_m)
    ds = Dataset.open(root)
    assert ds.readers["chat"][0].read_block(0).mask is not None
    m.format_version = 3
    with pytest.raises(ConfigError, match="not supported"):
        m.validate()


def test_format1_dataset_still_loads(tmp_path):
    root = str(tmp_path / "v1")
    write_random_dataset(root, {"web": 30})
    m = read_manifest(root)
    assert m.format_version == 1 and m.sources["web"].kind == "text" and m.chat_template is None
    raw = json.loads((tmp_path / "v1" / "manifest.json").read_text())
    for src in raw["sources"].values():  # a manifest written before `kind` and `chat_template` existed
        src.pop("kind", None)
    raw.pop("chat_template", None)
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps(raw))
    ds = Dataset.open(root)
    b = ds.readers["web"][0].read_block(0)
    assert b.mask is None and len(b.tokens)
    assert all(len(d) == 3 and d[2] is None for d in iter_documents(root, ds.manifest.sources["web"].shards,
                                                                    with_mask=True))
