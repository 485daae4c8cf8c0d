"""Lossless tensor deltas for incremental checkpoints: XOR of bit patterns against the base, byte-plane
shuffled, zstd-compressed; unchanged pieces are references, not bytes.

A rank writes `delta/rankNNNNN.bin` (concatenated blobs) and `delta/rankNNNNN.json` (index). Each entry
is one tensor piece: its global key, global shape and offset (megatron ShardedTensor coordinates), local
shape, dtype and codec:
  same      identical to the base: nothing stored
  xor-zstd  zstd(byte-shuffled(new XOR base))
  zstd      zstd(byte-shuffled(new)) when the base has no such piece
Pieces are applied by intersecting global regions, so a delta written under one TP/PP/DP layout applies to
base tensors loaded under another: XOR is elementwise.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DELTA_DIR = "delta"


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
    """XOR pattern (xor-zstd), full values (zstd) or None (same)."""
    if codec == "same":
        return None
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
            entries.append({"key": p.key, "global_shape": list(p.global_shape),
                            "global_offset": list(p.global_offset), "shape": list(p.tensor.shape),
                            "dtype": str(p.tensor.dtype).removeprefix("torch."), "codec": codec,
                            "offset": offset, "nbytes": len(blob), "raw_nbytes": b.nbytes})
            f.write(blob)
            offset += len(blob)
            full += b.nbytes
            same += codec == "same"
    with open(stem + ".json", "w") as f:
        json.dump({"rank": rank, "entries": entries}, f)
    return {"written": offset, "full": full, "pieces": len(pieces), "same": same}


class DeltaSet:
    """All ranks' delta entries of one incremental checkpoint, applied to base tensors by region."""

    def __init__(self, ckpt_dir: str):
        self.dir = ckpt_dir
        self.by_key: dict[str, list[tuple[str, dict]]] = {}
        ddir = os.path.join(ckpt_dir, DELTA_DIR)
        for name in sorted(os.listdir(ddir)):
            if not name.endswith(".json"):
                continue
            with open(os.path.join(ddir, name)) as f:
                idx = json.load(f)
            binf = os.path.join(ddir, name[:-5] + ".bin")
            for e in idx["entries"]:
                self.by_key.setdefault(e["key"], []).append((binf, e))

    def apply(self, key: str, global_offset: tuple, target: torch.Tensor) -> int:
        """Turn `target` (base values of region global_offset + target.shape) into the checkpoint's values,
        in place. Returns the number of pieces that touched it."""
        tcpu = target.detach().cpu().contiguous()  # a copy only for device or strided targets
        tb = bits(tcpu)
        touched = 0
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
                with open(binf, "rb") as f:
                    f.seek(e["offset"])
                    blob = f.read(e["nbytes"])
                d = decode(e["codec"], blob, tb.dtype, es).reshape(ext_e)
                if e["codec"] == "xor-zstd":
                    tview[tuple(sl_t)] ^= d[tuple(sl_e)]
                else:
                    tview[tuple(sl_t)] = d[tuple(sl_e)]
                touched += 1
        if tcpu is not target:
            target.copy_(tcpu)
        return touched
