"""Tensor pieces on disk: full checkpoints as raw bytes, incremental ones as lossless deltas (XOR of bit
patterns against the base, byte-plane shuffled, zstd-compressed; unchanged pieces are references).

A rank writes `<dir>/rankNNNNN.bin` (concatenated blobs) and `<dir>/rankNNNNN.json` (index), where <dir> is
`tensors/` for a full checkpoint and `delta/` for an incremental one. Each entry is one tensor piece: its
global key, global shape and offset (megatron ShardedTensor coordinates), local shape, dtype and codec:
  raw       the piece's bytes as they are in memory (full checkpoints: written at storage speed)
  same      identical to the base: nothing stored
  xor-zstd  zstd(byte-shuffled(new XOR base))
  zstd      zstd(byte-shuffled(new)) when the base has no such piece
Pieces are applied by intersecting global regions, so pieces written under one TP/PP/DP layout fill (raw)
or patch (XOR is elementwise) tensors loaded under another.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
import zstandard

from train.checkpoint.rawfile import aligned_offsets, write_stream

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DELTA_DIR = "delta"
RAW_DIR = "tensors"


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit pattern as a numpy integer array sharing memory (CPU tensors)."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy()


def _shuffle(a: np.ndarray) -> bytes:
    # Byte planes: exponent/sign bytes of floats change rarely and compress well once grouped.
    size = a.dtype.itemsize
    return np.ascontiguousarray(a.reshape(-1).view(np.uint8).reshape(-1, size).T).tobytes()


def _unshuffle(raw: bytes, int_dtype: np.dtype, shape: tuple) -> np.ndarray:
    size = int_dtype.itemsize
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(size, -1)
    return np.ascontiguousarray(planes.T).view(int_dtype).reshape(shape)


def encode(new: np.ndarray, base: np.ndarray | None, level: int = 3) -> tuple[str, bytes]:
    """(codec, blob) for one piece given its bit patterns and the base's (same shape) or None."""
    cctx = zstandard.ZstdCompressor(level=level)
    if base is None or base.shape != new.shape or base.dtype != new.dtype:
        return "zstd", cctx.compress(_shuffle(new))
    x = np.bitwise_xor(new, base)
    if not x.any():
        return "same", b""
    return "xor-zstd", cctx.compress(_shuffle(x))


def decode(codec: str, blob: bytes, int_dtype: np.dtype, shape: tuple) -> np.ndarray | None:
    """XOR pattern (xor-zstd), full values (zstd, raw) or None (same)."""
    if codec == "same":
        return None
    if codec == "raw":
        return np.frombuffer(blob, dtype=int_dtype).reshape(tuple(shape))
    raw = zstandard.ZstdDecompressor().decompress(blob)
    return _unshuffle(raw, np.dtype(int_dtype), tuple(shape))


@dataclass
class Piece:
    """A staged tensor piece: global key and coordinates plus a host copy of its values."""
    key: str
    global_shape: tuple
    global_offset: tuple
    tensor: torch.Tensor

    @property
    def ident(self) -> tuple:
        return (self.key, tuple(self.global_offset), tuple(self.tensor.shape))


def _entry(p: Piece, codec: str, offset: int, nbytes: int, raw_nbytes: int) -> dict:
    return {"key": p.key, "global_shape": list(p.global_shape), "global_offset": list(p.global_offset),
            "shape": list(p.tensor.shape), "dtype": str(p.tensor.dtype).removeprefix("torch."), "codec": codec,
            "offset": offset, "nbytes": nbytes, "raw_nbytes": raw_nbytes}


def write_deltas(out_dir: str, rank: int, pieces: list[Piece], base: dict[tuple, np.ndarray] | None,
                 level: int = 3) -> dict:
    """Write this rank's delta files; returns byte counts {written, full, pieces, same}."""
    os.makedirs(os.path.join(out_dir, DELTA_DIR), exist_ok=True)
    stem = os.path.join(out_dir, DELTA_DIR, f"rank{rank:05d}")
    entries, offset, full, same = [], 0, 0, 0
    with open(stem + ".bin", "wb") as f:
        for p in pieces:
            b = bits(p.tensor)
            codec, blob = encode(b, None if base is None else base.get(p.ident), level)
            entries.append(_entry(p, codec, offset, len(blob), b.nbytes))
            f.write(blob)
            offset += len(blob)
            full += b.nbytes
            same += codec == "same"
    with open(stem + ".json", "w") as f:
        json.dump({"rank": rank, "entries": entries}, f)
    return {"written": offset, "full": full, "pieces": len(pieces), "same": same}


def write_raw(out_dir: str, rank: int, pieces: list[Piece]) -> dict:
    """Write this rank's pieces as raw bytes (a full checkpoint) at storage speed (`rawfile.write_stream`,
    which also hashes them, so the commit need not read the file back).
    Returns {written, full, pieces, write_s (the tensor file's write, fsync included), files: {relative
    path: [size, xxh3_128 hex]}}."""
    os.makedirs(os.path.join(out_dir, RAW_DIR), exist_ok=True)
    rel = f"{RAW_DIR}/rank{rank:05d}"
    _take_recycled(os.path.dirname(os.path.abspath(out_dir)), os.path.join(out_dir, rel + ".bin"))
    views = [memoryview(bits(p.tensor.contiguous())).cast("B") for p in pieces]
    offsets = aligned_offsets(views)  # pieces go to disk from their own memory (zero padding between them)
    entries = [_entry(p, "raw", o, len(mv), len(mv)) for p, o, mv in zip(pieces, offsets, views)]
    t = time.perf_counter()
    size, digest = write_stream(os.path.join(out_dir, rel + ".bin"), views, offsets)
    write_s = time.perf_counter() - t
    index = json.dumps({"rank": rank, "entries": entries}).encode()
    with open(os.path.join(out_dir, rel + ".json"), "wb") as f:
        f.write(index)
    return {"written": size, "full": size, "pieces": len(pieces), "write_s": write_s,
            "files": {rel + ".bin": [size, digest], rel + ".json": [len(index), xxhash.xxh3_128_hexdigest(index)]}}


RECYCLE_DIR = ".recycle"  # under the checkpoint root: tensor files of deleted checkpoints


def retire(root: str, name: str) -> None:
    """Delete checkpoint `name` under `root`, keeping its raw tensor files in `root/.recycle` for the next
    full saves to overwrite. Writing a new file makes the filesystem allocate every block, which on ext4
    on the CI VM's disk runs at about 80 % of an overwrite (tools/bench/bench_ckpt.py); PostgreSQL
    recycles its WAL segments for the same reason. The pool holds the files of one checkpoint at most."""
    ckpt, pool = os.path.join(root, name), os.path.join(root, RECYCLE_DIR)
    raw = os.path.join(ckpt, RAW_DIR)
    bins = [f for f in os.listdir(raw) if f.endswith(".bin")] if os.path.isdir(raw) else []
    if bins:
        shutil.rmtree(pool, ignore_errors=True)
        os.makedirs(pool, exist_ok=True)
        for f in bins:
            os.rename(os.path.join(raw, f), os.path.join(pool, f"{name}-{f}"))
    shutil.rmtree(ckpt, ignore_errors=True)


def _take_recycled(root: str, path: str) -> bool:
    """Move a recycled tensor file to `path` (any rank may take any file; a rename lost to another rank
    just tries the next). False when the pool is empty."""
    pool = os.path.join(root, RECYCLE_DIR)
    try:
        names = sorted(os.listdir(pool))
    except FileNotFoundError:
        return False
    for n in names:
        try:
            os.rename(os.path.join(pool, n), path)
            return True
        except FileNotFoundError:
            continue
    return False


_NP_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # numpy twins of bits()' dtypes


def raw_snapshot(ckpt_dir: str, rank: int) -> dict[tuple, np.ndarray]:
    """This rank's pieces of a raw full checkpoint as bit-pattern arrays keyed like `Piece.ident`: views of
    a read-only map of the file (the page cache holds them; a map outlives the folder's rename)."""
    stem = os.path.join(ckpt_dir, RAW_DIR, f"rank{rank:05d}")
    with open(stem + ".json") as f:
        entries = json.load(f)["entries"]
    if not entries:
        return {}
    mm = np.memmap(stem + ".bin", dtype=np.uint8, mode="r")
    out = {}
    for e in entries:
        size = torch.empty(0, dtype=getattr(torch, e["dtype"])).element_size()
        view = mm[e["offset"]:e["offset"] + e["nbytes"]].view(_NP_INT_OF_SIZE[size]).reshape(e["shape"])
        out[(e["key"], tuple(e["global_offset"]), tuple(e["shape"]))] = view
    return out


class PieceSet:
    """All ranks' piece entries of one checkpoint folder (`tensors/` or `delta/`), applied to tensors by
    global region: raw/zstd pieces overwrite, xor-zstd pieces patch, same pieces are skipped."""

    def __init__(self, ckpt_dir: str, subdir: str = DELTA_DIR):
        self.dir = ckpt_dir
        self.by_key: dict[str, list[tuple[str, dict]]] = {}
        self._maps: dict[str, np.memmap] = {}
        self.elements = 0  # target elements filled or patched by the last apply()
        ddir = os.path.join(ckpt_dir, subdir)
        for name in sorted(os.listdir(ddir)):
            if not name.endswith(".json"):
                continue
            with open(os.path.join(ddir, name)) as f:
                idx = json.load(f)
            binf = os.path.join(ddir, name[:-5] + ".bin")
            for e in idx["entries"]:
                self.by_key.setdefault(e["key"], []).append((binf, e))

    def keys(self) -> list[str]:
        return list(self.by_key)

    def entries(self, key: str) -> list[dict]:
        return [e for _, e in self.by_key.get(key, [])]

    def _blob(self, binf: str, e: dict):
        if e["codec"] == "raw":  # zero-copy: a view of the file's map
            if binf not in self._maps:
                self._maps[binf] = np.memmap(binf, dtype=np.uint8, mode="r")
            return self._maps[binf][e["offset"]:e["offset"] + e["nbytes"]]
        with open(binf, "rb") as f:
            f.seek(e["offset"])
            return f.read(e["nbytes"])

    def apply(self, key: str, global_offset: tuple, target: torch.Tensor) -> int:
        """Turn `target` (base values of region global_offset + target.shape) into the checkpoint's values,
        in place. Returns the number of pieces that touched it; `self.elements` counts the elements."""
        tcpu = target.detach().cpu().contiguous()  # a copy only for device or strided targets
        tb = bits(tcpu)
        touched, self.elements = 0, 0
        g = len(global_offset)
        # Local pieces may omit leading (stacked-layer) axes of the global tensor: give them extent 1.
        ext_t = [1] * (g - tb.ndim) + list(tb.shape)
        tview = tb.reshape(ext_t)
        for binf, e in self.by_key.get(key, []):
            if e["codec"] == "same":
                continue
            eo, es = e["global_offset"], e["shape"]
            ext_e = [1] * (len(eo) - len(es)) + list(es)
            if len(eo) != g:
                raise ValueError(f"{binf}: {key} has {len(eo)} global dims, the target has {g}")
            sl_t, sl_e = [], []
            for to, ts, o, s in zip(global_offset, ext_t, eo, ext_e):
                lo, hi = max(to, o), min(to + ts, o + s)
                if lo >= hi:
                    break
                sl_t.append(slice(lo - to, hi - to))
                sl_e.append(slice(lo - o, hi - o))
            else:
                d = decode(e["codec"], self._blob(binf, e), tb.dtype, es).reshape(ext_e)
                if e["codec"] == "xor-zstd":
                    tview[tuple(sl_t)] ^= d[tuple(sl_e)]
                else:
                    tview[tuple(sl_t)] = d[tuple(sl_e)]
                touched += 1
                self.elements += int(np.prod([sl.stop - sl.start for sl in sl_t]))
        if tcpu.data_ptr() != target.data_ptr():  # we worked on a copy
            with torch.no_grad():
                target.copy_(tcpu)
        return touched
