"""Shard format v2 (blocks with a loss mask): round trips, index, stock tools, webdataset, corruption,
and format 1 data and manifests still loading."""
from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import lz4.frame
import numpy as np
import pytest

from storage.dataset import Dataset, SourceWriter, iter_documents
from storage.manifest import Manifest, TokenizerInfo, read_manifest, write_manifest
from storage.shard_writer import ShardWriter
from storage.shards import ShardError, ShardReader, decode_mask, iter_shard, parse_index, scan_index
from storage.config import ConfigError

from testutil import require_tool

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


FORMAT1 = Path(__file__).parent / "format1_dataset"  # written by the format 1 code: see its README.md


def _stock_blocks(shard: Path, dtype: np.dtype) -> list[tuple[bytes, dict]]:
    """(decoded token bytes, JSON metadata) per block of a shard, read with tarfile + lz4 alone."""
    out = []
    with tarfile.open(shard) as tar:
        members = tar.getmembers()
        assert len(members) % 2 == 0
        for tok, meta in zip(members[::2], members[1::2], strict=True):
            assert tok.name.endswith(".tokens.lz4") and meta.name == tok.name[:-len("tokens.lz4")] + "json"
            raw = lz4.frame.decompress(tar.extractfile(tok).read())
            assert len(raw) % dtype.itemsize == 0
            out.append((raw, json.loads(tar.extractfile(meta).read())))
    return out


def test_format1_dataset_still_loads(tmp_path):
    import hashlib

    import torch

    from storage.loader import LoaderConfig, TokenLoader

    # the fixture is byte for byte what the format 1 code wrote
    listed = dict(reversed(line.split("  ", 1)) for line in (FORMAT1 / "SHA256SUMS").read_text().splitlines())
    files = {str(p.relative_to(FORMAT1)) for p in FORMAT1.rglob("*") if p.is_file()}
    assert files == set(listed) | {"SHA256SUMS", "README.md"}
    for name, digest in listed.items():
        assert hashlib.sha256((FORMAT1 / name).read_bytes()).hexdigest() == digest, name
    root = tmp_path / "v1"
    shutil.copytree(FORMAT1, root)  # nothing below may write into the repository
    raw = json.loads((root / "manifest.json").read_text())
    assert raw["format_version"] == 1 and "chat_template" not in raw
    assert all("kind" not in src for src in raw["sources"].values())  # written before `kind` existed
    m = read_manifest(str(root))
    assert m.format_version == 1 and m.chat_template is None
    assert {n: s.kind for n, s in m.sources.items()} == {"web": "text", "docs": "text"}
    dtype = np.dtype(m.tokenizer.dtype).newbyteorder("<")

    # every block (training and held-out): today's readers give the stock decoder's bytes and no mask,
    # and today's writer, given the same blocks, writes the format 1 shard and index byte for byte
    ds = Dataset.open(str(root))
    blocks = {}  # source → decoded blocks in shard order (the loader check below)
    n_blocks = 0
    for infos, readers in ((m.sources, ds.readers), (m.validation, ds.validation_readers)):
        assert set(readers) == {"web", "docs"}
        for name, src in infos.items():
            for sh, reader in zip(src.shards, readers[name], strict=True):
                stock = _stock_blocks(root / sh.path, dtype)
                assert len(stock) == len(reader) == sh.blocks
                seq = list(iter_shard(str(root / sh.path), sh.sha256))
                rewritten = tmp_path / "rewrite" / sh.path
                with ShardWriter(str(rewritten), m.tokenizer.dtype, name) as w:
                    for k, (tokens, meta) in enumerate(stock):
                        for b in (reader.read_block(k), seq[k]):
                            assert b.mask is None and b.tokens.dtype == dtype and b.tokens.tobytes() == tokens
                            assert (b.doc_ids, b.offsets, b.source) == (meta["doc_ids"], meta["offsets"], name)
                        w.add_block(np.frombuffer(tokens, dtype), meta["doc_ids"], meta["offsets"])
                        if infos is m.sources:
                            blocks.setdefault(name, []).append(np.frombuffer(tokens, dtype).astype(np.int64))
                        n_blocks += 1
                assert rewritten.read_bytes() == (root / sh.path).read_bytes(), sh.path
                idx = sh.path + ".idx"
                assert (tmp_path / "rewrite" / idx).read_bytes() == (root / idx).read_bytes(), idx
            docs = list(iter_documents(str(root), src.shards, with_mask=True))
            assert len(docs) == src.documents and all(d[2] is None for d in docs)
    assert n_blocks == sum(s.blocks for src in (*m.sources.values(), *m.validation.values()) for s in src.shards)

    # today's loader over the format 1 manifest's two-phase mix: every row is the seq_len + 1 tokens its
    # (source, position) names in that source's block stream, rebuilt here from the stock decoder's blocks
    seq_len, G, n_batches = 64, 8, 24
    with TokenLoader(LoaderConfig(dataset=str(root), seq_len=seq_len, seed=3, shuffle_window=8,
                                  prefetch_threads=2, decode_processes=0), G) as loader:
        rows = torch.cat([next(loader).clone() for _ in range(n_batches)]).numpy()
        srcs, curs = loader.assignments(0, len(rows))
        orders = loader.orders
    assert set(srcs.tolist()) == {0, 1}  # both sources were drawn
    names = [o.name for o in orders]
    streams: dict = {}
    for row, s, k in zip(rows, srcs, curs, strict=True):
        epoch, q = orders[s].position(int(k))
        if (s, epoch) not in streams:
            streams[s, epoch] = np.concatenate([blocks[names[s]][b] for b in orders[s]._epoch(epoch)[0]])
        np.testing.assert_array_equal(row, streams[s, epoch][q * seq_len: q * seq_len + seq_len + 1])
