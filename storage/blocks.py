"""The block codec of shard formats v1 and v2 (see `storage.shards`): member names, `ShardError`, `Block`,
and checked encoding and decoding of one block's members (LZ4 token frame, JSON metadata, LZ4 mask frame).

Split from `storage.shards` (which re-exports every public name here) so the format's byte-level rules
sit in one small module; readers and the writer build on it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import lz4.frame
import numpy as np
import orjson

from storage import codec

FORMAT_VERSION = 2  # newest block format: 1 = tokens + JSON, 2 = tokens + JSON + loss mask
TOKENS_EXT = "tokens.lz4"
META_EXT = "json"
MASK_EXT = "mask.lz4"
# 1 MiB frame blocks decode fastest here; integrity comes from an xxh3-64 of the frame in the block's
# JSON (about 5x cheaper than LZ4's own xxh32 content checksum, which would halve decode speed).
_LZ4_BLOCK_SIZE = lz4.frame.BLOCKSIZE_MAX1MB


class ShardError(ValueError):
    """A shard that cannot be trusted: names the shard, the member and the byte offset."""

    def __init__(self, shard: str, msg: str, member: str | None = None, offset: int | None = None):
        where = shard
        if member is not None:
            where += f", member {member}"
        if offset is not None:
            where += f", offset {offset}"
        super().__init__(f"{where}: {msg}")
        self.shard, self.member, self.offset, self.msg = shard, member, offset, msg

    def __reduce__(self):  # pickles with its fields (loader worker processes send it to the consumer)
        return type(self), (self.shard, self.msg, self.member, self.offset)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def parse_dtype(name: str) -> np.dtype:
    if name not in ("uint16", "uint32"):
        raise ValueError(f"token dtype must be uint16 or uint32, got {name!r}")
    return np.dtype("<u2") if name == "uint16" else np.dtype("<u4")


@dataclass
class Block:
    """One decoded sample: whole documents' tokens plus their ids and offsets (len(doc_ids) + 1)."""
    key: str
    tokens: np.ndarray
    doc_ids: list[str]
    offsets: list[int]
    source: str
    mask: np.ndarray | None = None  # uint8 0/1 loss mask, one per token (format 2 blocks), else None
    doc_meta: list[dict] | None = None  # per-document JSON objects (the JSON's optional `doc_meta`), else None


def encode_tokens(tokens: np.ndarray, dtype: np.dtype, compression_level: int = 0) -> bytes:
    arr = np.ascontiguousarray(tokens)
    if arr.dtype != dtype:
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(dtype).max):
            raise ValueError(f"token ids out of range for {dtype.name}")
        arr = arr.astype(dtype)
    return lz4.frame.compress(arr.tobytes(), compression_level=compression_level, block_size=_LZ4_BLOCK_SIZE,
                              content_checksum=False)


_HEAD = re.compile(rb'"dtype":"(uint16|uint32)","n_tokens":(\d+),"xxh3_64":"([0-9a-f]{16})"')


def _checked_tokens(shard: str, key: str, payload, dtype: np.dtype, n: int, digest: str, offset: int, verify: bool,
                    out: np.ndarray | None) -> np.ndarray:
    member = f"{key}.{TOKENS_EXT}"
    if verify and codec.xxh3_64(payload) != int(digest, 16):
        raise ShardError(shard, f"checksum mismatch: xxh3_64 of the LZ4 frame is not {digest} (corrupt block)",
                         member, offset)
    if out is None:
        if n * dtype.itemsize > 255 * len(payload) + 64:  # beyond LZ4's best ratio: the count is corrupt
            raise ShardError(shard, f"metadata says {n} tokens, more than a {len(payload)}-byte LZ4 frame can hold",
                             f"{key}.{META_EXT}")
        out = np.empty(n, dtype=dtype)
    elif out.dtype != dtype or len(out) < n:
        raise ShardError(shard, f"block holds {n} {dtype.name} tokens; expected at most {len(out)} {out.dtype.name} "
                         "(the dataset's dtype and largest block)", f"{key}.{META_EXT}")
    try:
        size = codec.decompress_into(payload, out)
    except codec.FrameError as e:
        raise ShardError(shard, f"LZ4 frame does not decode ({e})", member, offset) from None
    if size != n * dtype.itemsize:
        raise ShardError(shard, f"decoded {size} bytes, metadata says {n} {dtype.name} tokens", member, offset)
    return out[:n]


def _parse_meta(shard: str, key: str, meta_bytes) -> tuple[dict, np.dtype, int, str]:
    """(the JSON member, token dtype, token count, xxh3_64 hex digest), all checked."""
    try:
        meta = orjson.loads(meta_bytes)
        dtype = parse_dtype(meta["dtype"])
        doc_ids, offsets, n = meta["doc_ids"], meta["offsets"], int(meta["n_tokens"])
        digest = meta["xxh3_64"]
        int(digest, 16)
        if "mask_xxh3_64" in meta:
            int(meta["mask_xxh3_64"], 16)
    except (ValueError, KeyError, TypeError) as e:  # orjson.JSONDecodeError is a ValueError
        raise ShardError(shard, f"bad block metadata: {e}", f"{key}.{META_EXT}") from None
    if len(offsets) != len(doc_ids) + 1 or (offsets and (offsets[0] != 0 or offsets[-1] != n)):
        raise ShardError(shard, "document offsets do not match the token count", f"{key}.{META_EXT}")
    doc_meta = meta.get("doc_meta")
    if doc_meta is not None and (not isinstance(doc_meta, list) or len(doc_meta) != len(doc_ids)
                                 or not all(isinstance(d, dict) for d in doc_meta)):
        raise ShardError(shard, f"bad block metadata: doc_meta must be a list of {len(doc_ids)} objects, one per "
                         "document", f"{key}.{META_EXT}")
    return meta, dtype, n, digest


def _checked_mask(shard: str, key: str, payload, n: int, digest: str, offset: int, verify: bool) -> np.ndarray:
    member = f"{key}.{MASK_EXT}"
    if verify and codec.xxh3_64(payload) != int(digest, 16):
        raise ShardError(shard, f"checksum mismatch: xxh3_64 of the mask's LZ4 frame is not {digest} (corrupt "
                         "mask)", member, offset)
    if n > 255 * len(payload) + 64:
        raise ShardError(shard, f"metadata says {n} tokens, more than a {len(payload)}-byte mask frame can hold",
                         member, offset)
    out = np.empty(n, dtype=np.uint8)
    try:
        size = codec.decompress_into(payload, out)
    except codec.FrameError as e:
        raise ShardError(shard, f"LZ4 frame does not decode ({e})", member, offset) from None
    if size != n:
        raise ShardError(shard, f"mask has {size} entries, metadata says {n} tokens", member, offset)
    if n and int(out.max()) > 1:
        raise ShardError(shard, "mask holds values other than 0 and 1", member, offset)
    return out


def decode_block(shard: str, key: str, payload: bytes | memoryview, meta_bytes: bytes | memoryview, offset: int,
                 verify: bool = True, mask_payload: bytes | memoryview | None = None,
                 mask_offset: int | None = None) -> Block:
    """Check and decode one block; `verify=False` skips the xxh3 checks (the LZ4 decoder still runs).
    A format 2 block's JSON names a mask: `mask_payload` must then be its `KEY.mask.lz4` member."""
    meta, dtype, n, digest = _parse_meta(shard, key, meta_bytes)
    tokens = _checked_tokens(shard, key, payload, dtype, n, digest, offset, verify, None)
    mask = None
    if "mask_xxh3_64" in meta:
        if mask_payload is None:
            raise ShardError(shard, f"block metadata names a mask but the sample has no {MASK_EXT} member",
                             f"{key}.{MASK_EXT}", offset)
        mask = _checked_mask(shard, key, mask_payload, n, meta["mask_xxh3_64"],
                             offset if mask_offset is None else mask_offset, verify)
    elif mask_payload is not None:
        raise ShardError(shard, "sample has a mask member its metadata does not name (no mask_xxh3_64)",
                         f"{key}.{MASK_EXT}", mask_offset)
    return Block(key, tokens, meta["doc_ids"], meta["offsets"], meta.get("source", ""), mask, meta.get("doc_meta"))


_MASK_HEAD = re.compile(rb'"n_tokens":(\d+),"xxh3_64":"[0-9a-f]{16}","mask_xxh3_64":"([0-9a-f]{16})"')


def decode_mask(shard: str, key: str, mask_payload: bytes | memoryview, meta_bytes: bytes | memoryview,
                offset: int, verify: bool = True) -> np.ndarray:
    """The loader's path for masks: check and decode one format 2 block's `KEY.mask.lz4` (uint8, one entry per
    token) with the count and checksum from the first bytes of its JSON member (full parse otherwise)."""
    head = _MASK_HEAD.search(bytes(meta_bytes[:300]))
    if head is not None:
        n, digest = int(head[1]), head[2].decode()
    else:
        meta, _, n, _ = _parse_meta(shard, key, meta_bytes)
        if "mask_xxh3_64" not in meta:
            raise ShardError(shard, "block has no loss mask (format 1 block)", f"{key}.{META_EXT}", offset)
        digest = meta["mask_xxh3_64"]
    return _checked_mask(shard, key, mask_payload, n, digest, offset, verify)


def decode_tokens(shard: str, key: str, payload: bytes | memoryview, meta_bytes: bytes | memoryview, offset: int,
                  out: np.ndarray) -> np.ndarray:
    """The streaming loader's path: check and decode one block's tokens into `out` (C-contiguous, of the
    block's dtype, long enough); returns the view of `out` that holds them.

    Only dtype, n_tokens and xxh3_64 are needed. The writer puts them first in the JSON member, so they
    come from its first bytes without parsing the document lists (which cost about as much as the
    checksum); JSON in another layout takes the full parse."""
    head = _HEAD.search(bytes(meta_bytes[:256]))
    if head is None:
        _, dtype, n, digest = _parse_meta(shard, key, meta_bytes)
    else:
        dtype, n, digest = parse_dtype(head[1].decode()), int(head[2]), head[3].decode()
    return _checked_tokens(shard, key, payload, dtype, n, digest, offset, True, out)
