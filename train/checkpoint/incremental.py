"""Tensor pieces on disk: full checkpoints as raw bytes, incremental ones as lossless deltas (XOR of bit
patterns against the base, split into byte planes, each plane stored raw or zstd-compressed; unchanged
pieces are references).

A rank writes `<dir>/rankNNNNN.bin` (concatenated blobs) and `<dir>/rankNNNNN.json` (index), where <dir> is
`tensors/` for a full checkpoint and `delta/` for an incremental one. Each entry is one tensor piece: its
global key, global shape and offset (megatron ShardedTensor coordinates), local shape, dtype and codec:
  raw         the piece's bytes as they are in memory (full checkpoints: written at storage speed)
  same        identical to the base: nothing stored
  xor-planes  new XOR base, in chunks of CHUNK_ELEMS elements; per chunk its byte planes (plane i: byte i
              of every element), each "raw" or "zstd", listed in the entry's `chunks`: [elements,
              [method, nbytes] per plane] or [elements, "same"]
  planes      the same layout for new itself, when the base has no such piece
  xor-zstd, zstd   (read only: incremental checkpoints written before xor-planes) zstd of the whole
              byte-shuffled XOR pattern / values
Why planes: after AdamW steps the low mantissa bytes of fp32 values are new random bits in every element
(incompressible), while sign/exponent bytes hardly change; compressing only the planes that shrink (tried
on a sample first) keeps the bytes of compressing everything and skips most of its time. Chunks are
encoded by a thread per CPU (numpy's XOR and zstd release the GIL) while the O_DIRECT writer streams
and hashes what is done (`rawfile.write_stream`). tools/bench/bench_ckpt.py measures it.
Pieces are applied by intersecting global regions, so pieces written under one TP/PP/DP layout fill (raw)
or patch (XOR is elementwise) tensors loaded under another.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from train.checkpoint.planes import CHUNK_ELEMS, Scratch, bits, codec_name, decode, encode_chunk
from train.checkpoint.rawfile import aligned_offsets, write_stream

DELTA_DIR = "delta"
RAW_DIR = "tensors"


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


def _chunk_jobs(pieces: list[Piece], base: dict[tuple, np.ndarray] | None):
    """(piece index, new chunk, base chunk or None) in file order."""
    for i, p in enumerate(pieces):
        b = bits(p.tensor).reshape(-1)
        bb = None if base is None else base.get(p.ident)
        if bb is not None and (bb.shape != tuple(p.tensor.shape) or bb.dtype != b.dtype):
            bb = None
        bb = None if bb is None else bb.reshape(-1)
        for at in range(0, max(len(b), 1), CHUNK_ELEMS):
            yield i, b[at:at + CHUNK_ELEMS], None if bb is None else bb[at:at + CHUNK_ELEMS]


def _entry(p: Piece, codec: str, offset: int, nbytes: int, raw_nbytes: int) -> dict:
    return {"key": p.key, "global_shape": list(p.global_shape), "global_offset": list(p.global_offset),
            "shape": list(p.tensor.shape), "dtype": str(p.tensor.dtype).removeprefix("torch."), "codec": codec,
            "offset": offset, "nbytes": nbytes, "raw_nbytes": raw_nbytes}


def write_deltas(out_dir: str, rank: int, pieces: list[Piece], base: dict[tuple, np.ndarray] | None,
                 level: int = 1, threads: int = 0) -> dict:
    """Write this rank's delta files: every piece's chunks encoded by `threads` threads (0: one per CPU
    this process may use), in order, into the O_DIRECT writer, which hashes the stream. Returns {written,
    full, pieces, same, write_s, files: {relative path: [size, xxh3_128 hex]}} (as write_raw)."""
    os.makedirs(os.path.join(out_dir, DELTA_DIR), exist_ok=True)
    rel = f"{DELTA_DIR}/rank{rank:05d}"
    jobs = list(_chunk_jobs(pieces, base))
    records: list[list] = [[] for _ in pieces]
    with_base = [False] * len(pieces)
    n = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    pool = ThreadPoolExecutor(n, thread_name_prefix="ckpt-delta")
    itemsize = max((bits(p.tensor).itemsize for p in pieces), default=1)
    free = [Scratch(itemsize) for _ in range(2 * n)]  # a chunk's scratch returns once the writer copied it

    def encoded():  # buffers in file order, at most 2n chunks encoded ahead of the writer
        window: deque = deque()
        todo = iter(jobs)
        while True:
            while free and (job := next(todo, None)) is not None:
                i, new, old = job
                with_base[i] = old is not None
                sc = free.pop()
                window.append((i, sc, pool.submit(encode_chunk, new, old, level, sc)))
            if not window:
                return
            i, sc, fut = window.popleft()
            rec, bufs = fut.result()
            records[i].append(rec)
            yield from bufs
            free.append(sc)  # write_stream(copy=True) has copied every part before asking for the next

    t = time.perf_counter()
    try:
        size, digest = write_stream(os.path.join(out_dir, rel + ".bin"), encoded(), copy=True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    write_s = time.perf_counter() - t
    entries, offset, full, same = [], 0, 0, 0
    for p, recs, wb in zip(pieces, records, with_base):
        nbytes = sum(nb for r in recs if r[1] != "same" for _, nb in r[1:])
        raw_nbytes = bits(p.tensor).nbytes
        codec = codec_name(wb, recs)
        e = _entry(p, codec, offset, nbytes, raw_nbytes)
        if codec != "same":
            e["chunks"] = recs
        entries.append(e)
        offset += nbytes
        full += raw_nbytes
        same += codec == "same"
    if offset != size:
        raise RuntimeError(f"{rel}.bin: wrote {size} bytes, the index accounts for {offset}")
    index = json.dumps({"rank": rank, "entries": entries}).encode()
    with open(os.path.join(out_dir, rel + ".json"), "wb") as f:
        f.write(index)
    return {"written": offset, "full": full, "pieces": len(pieces), "same": same, "write_s": write_s,
            "files": {rel + ".bin": [size, digest], rel + ".json": [len(index), xxhash.xxh3_128_hexdigest(index)]}}


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
    global region: raw/planes/zstd pieces overwrite, xor-* pieces patch, same pieces are skipped."""

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
                d = decode(e, self._blob(binf, e), tb.dtype).reshape(ext_e)
                if e["codec"].startswith("xor-"):
                    tview[tuple(sl_t)] ^= d[tuple(sl_e)]
                else:
                    tview[tuple(sl_t)] = d[tuple(sl_e)]
                touched += 1
                self.elements += int(np.prod([sl.stop - sl.start for sl in sl_t]))
        if tcpu.data_ptr() != target.data_ptr():  # we worked on a copy
            with torch.no_grad():
                target.copy_(tcpu)
        return touched
