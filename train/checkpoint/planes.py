"""The byte-plane codec of incremental checkpoints: a tensor piece's bit pattern XOR its base's (or the
values themselves), in chunks of CHUNK_ELEMS elements, each chunk split into byte planes (plane i: byte i
of every element) stored raw or zstd-compressed, whichever is smaller on a sample. train.checkpoint.
incremental writes and reads the files; this module only turns arrays into planes and back.
"""
from __future__ import annotations

import threading

import numpy as np
import torch
import zstandard

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit pattern as a numpy integer array sharing memory (CPU tensors)."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy()


def _unshuffle(raw: bytes, int_dtype: np.dtype, shape: tuple) -> np.ndarray:
    size = int_dtype.itemsize
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(size, -1)
    return np.ascontiguousarray(planes.T).view(int_dtype).reshape(shape)


CHUNK_ELEMS = 1 << 20  # elements per encoded chunk (4 MiB of fp32): the unit of parallel work
_SAMPLE = 1 << 14      # bytes of a plane compressed first: if they do not shrink, the plane is stored raw
_WORTH = 0.97          # a compressed plane must be smaller than this fraction of its raw bytes
_local = threading.local()


class Scratch:
    """Reusable memory for one chunk: its XOR pattern and its byte planes (fresh arrays per chunk would
    cost a page fault per 4 KiB, a large share of the encode on a VM)."""

    def __init__(self, max_itemsize: int = 8):
        self.x = np.empty(CHUNK_ELEMS * max_itemsize, dtype=np.uint8)
        self.planes = np.empty(CHUNK_ELEMS * max_itemsize, dtype=np.uint8)


def _cctx(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor (a ZstdCompressor must not be used by two threads at once). Level 1 (the
    default): zstd's fast strategy looking only for matches of 7+ bytes in a small hash table; on the
    sign/exponent planes of AdamW states (a few distinct bytes in short runs) it compresses as well as
    level 1 in about half the time (measured: tools/bench/bench_ckpt.py, docs/benchmarks.md)."""
    c = getattr(_local, "cctx", None)
    if c is None or _local.level != level:
        params = (zstandard.ZstdCompressionParameters(strategy=zstandard.STRATEGY_FAST, min_match=7, hash_log=10,
                                                      search_log=1, window_log=18) if level <= 1 else
                  zstandard.ZstdCompressionParameters.from_level(level))
        c, _local.level = zstandard.ZstdCompressor(compression_params=params), level
        _local.cctx = c
    return c


def _encode_plane(raw: np.ndarray, level: int) -> tuple[str, memoryview]:
    """("raw" | "zstd", bytes) for one byte plane: random low mantissa bytes are stored as they are at
    memory speed; only planes that shrink (sign, exponent, high mantissa) pay for zstd."""
    cctx = _cctx(level)
    if len(raw) > 4 * _SAMPLE and len(cctx.compress(raw[:_SAMPLE])) > _WORTH * _SAMPLE:
        return "raw", memoryview(raw)
    blob = cctx.compress(raw)
    if len(blob) > _WORTH * len(raw):
        return "raw", memoryview(raw)
    return "zstd", memoryview(blob)


def encode_chunk(new: np.ndarray, base: np.ndarray | None, level: int,
                 scratch: Scratch | None = None) -> tuple[list, list[memoryview]]:
    """One chunk (1-D bit patterns, at most CHUNK_ELEMS) of a piece: its index record [elements, [method,
    nbytes] per byte plane] ([elements, "same"] when unchanged) and the plane buffers, in file order. With
    a base the planes hold new XOR base, else new itself. Raw planes are views of `scratch` (valid until
    it is reused)."""
    scratch = scratch or Scratch(new.dtype.itemsize)
    n, size = len(new), new.dtype.itemsize
    if base is None:
        x = new
    else:
        x = np.bitwise_xor(new, base, out=scratch.x[:n * size].view(new.dtype))
        if not x[:1024].any() and not x.any():
            return [n, "same"], []
    u = x.view(np.uint8)
    parts = []
    for i in range(size):
        plane = scratch.planes[i * n:(i + 1) * n]
        np.copyto(plane, u[i::size])
        parts.append(_encode_plane(plane, level))
    return [n, *[[m, len(b)] for m, b in parts]], [b for _, b in parts]


def encode(new: np.ndarray, base: np.ndarray | None, level: int = 1) -> tuple[str, list, list[memoryview]]:
    """(codec, chunk records, buffers in file order) for one whole piece given its bit patterns and the
    base's (same shape and dtype) or None; single-threaded (write_deltas spreads the chunks over threads)."""
    usable = base is not None and base.shape == new.shape and base.dtype == new.dtype
    flat, bflat = new.reshape(-1), base.reshape(-1) if usable else None
    records, bufs = [], []
    for at in range(0, max(len(flat), 1), CHUNK_ELEMS):
        rec, b = encode_chunk(flat[at:at + CHUNK_ELEMS], None if bflat is None else bflat[at:at + CHUNK_ELEMS], level)
        records.append(rec)
        bufs += b
    return codec_name(usable, records), records, bufs


def codec_name(with_base: bool, records: list) -> str:
    if with_base and all(r[1] == "same" for r in records):
        return "same"
    return "xor-planes" if with_base else "planes"


def decode(e: dict, blob: bytes | memoryview, int_dtype: np.dtype) -> np.ndarray | None:
    """The piece of index entry `e` from its stored bytes: the XOR pattern (xor-*), the values (planes,
    zstd, raw) or None (same), shaped as the piece."""
    codec, shape, int_dtype = e["codec"], tuple(e["shape"]), np.dtype(int_dtype)
    if codec == "same":
        return None
    if codec == "raw":
        return np.frombuffer(blob, dtype=int_dtype).reshape(shape)
    if codec in ("xor-zstd", "zstd"):
        return _unshuffle(zstandard.ZstdDecompressor().decompress(blob), int_dtype, shape)
    size = int_dtype.itemsize
    out = np.empty(int(np.prod(shape, dtype=np.int64)), dtype=int_dtype)
    u = out.view(np.uint8)
    dctx = zstandard.ZstdDecompressor()
    pos, el = 0, 0
    for n, *planes in e["chunks"]:
        if planes == ["same"]:
            out[el:el + n] = 0  # no change: XOR with zero
        else:
            for i, (method, nbytes) in enumerate(planes):
                data = blob[pos:pos + nbytes]
                pos += nbytes
                plane = data if method == "raw" else dctx.decompress(data, max_output_size=n)
                u[el * size + i:(el + n) * size:size] = np.frombuffer(plane, dtype=np.uint8)
        el += n
    if el != len(out) or pos != len(blob):
        raise ValueError(f"{e['key']}: chunks cover {el} of {len(out)} elements and {pos} of {len(blob)} bytes")
    return out.reshape(shape)
