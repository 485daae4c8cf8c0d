"""Writes one shard of format v1, or v2 for blocks with a loss mask (see `storage.shards`), and its
DALI-style index, atomically."""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from typing import BinaryIO

import numpy as np
import xxhash

from storage import atomic
from storage.shards import (INDEX_SUFFIX, MASK_EXT, META_EXT, TAR_BLOCK, TOKENS_EXT, IndexEntry, encode_tokens,
                            parse_dtype)

_MASK_DTYPE = np.dtype(np.uint8)


class _HashingWriter(io.RawIOBase):
    def __init__(self, f: BinaryIO):
        self.f, self.sha, self.pos = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.sha.update(b)
        self.f.write(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = size, 0o644, 0, 0, 0, "", ""
    return ti


class ShardWriter:
    """Writes one shard and its index under temporary names; `close()` publishes both atomically.

    Output bytes depend only on the blocks added (fixed mtime/owner), so builds are reproducible.
    """

    def __init__(self, url: str, dtype: np.dtype | str, source: str, compression_level: int = 0):
        self.url, self.source, self.compression_level = url, source, compression_level
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        self.stem = os.path.basename(url).split(".")[0]
        self._out = atomic.AtomicFile(url)  # `.tmp-<name>` locally, an upload (aborted on failure) remotely
        self._file: BinaryIO = self._out.file
        self._hw = _HashingWriter(self._file)
        self._tar = tarfile.open(fileobj=self._hw, mode="w", format=tarfile.USTAR_FORMAT)  # type: ignore
        self.entries: list[IndexEntry] = []
        self.block_tokens: list[int] = []
        self.documents = self.tokens = 0
        self._closed = False

    def add_block(self, tokens: np.ndarray, doc_ids: list[str], offsets: list[int],
                  mask: np.ndarray | None = None, doc_meta: list[dict] | None = None) -> str:
        """Append one block; with `mask` (0/1 per token) it is a format 2 block with a `KEY.mask.lz4` member.
        `doc_meta` (one JSON object per document, e.g. a prompt's answer) goes into the JSON member as
        `doc_meta`, after `offsets`; readers that do not know it ignore it."""
        n = int(len(tokens))
        if len(offsets) != len(doc_ids) + 1 or offsets[0] != 0 or offsets[-1] != n:
            raise ValueError(f"offsets must have len(doc_ids)+1 entries from 0 to {n}")
        if doc_meta is not None and (len(doc_meta) != len(doc_ids) or not all(isinstance(d, dict) for d in doc_meta)):
            raise ValueError(f"doc_meta must hold one dict per document ({len(doc_ids)})")
        mask_payload = None
        head = {"format": 1, "source": self.source, "dtype": self.dtype.name, "n_tokens": n}
        payload = encode_tokens(tokens, self.dtype, self.compression_level)
        head["xxh3_64"] = xxhash.xxh3_64_hexdigest(payload)
        if mask is not None:
            m = np.asarray(mask)
            if m.shape != (n,):
                raise ValueError(f"mask has shape {m.shape}, expected ({n},) (one entry per token)")
            if n and (int(m.min()) < 0 or int(m.max()) > 1):
                raise ValueError("mask values must be 0 or 1")
            mask_payload = encode_tokens(m, _MASK_DTYPE, self.compression_level)
            head["format"] = 2
            head["mask_xxh3_64"] = xxhash.xxh3_64_hexdigest(mask_payload)
        key = f"{self.stem}_{len(self.entries):06d}"
        body = {**head, "doc_ids": [str(d) for d in doc_ids], "offsets": [int(o) for o in offsets]}
        if doc_meta is not None:
            body["doc_meta"] = doc_meta
        meta = json.dumps(body, separators=(",", ":")).encode()
        t_off = self._hw.tell()
        self._tar.addfile(_tarinfo(f"{key}.{TOKENS_EXT}", len(payload)), io.BytesIO(payload))
        m_off = self._hw.tell()
        self._tar.addfile(_tarinfo(f"{key}.{META_EXT}", len(meta)), io.BytesIO(meta))
        k_off, k_size = -1, 0
        if mask_payload is not None:
            k_off, k_size = self._hw.tell(), len(mask_payload)
            self._tar.addfile(_tarinfo(f"{key}.{MASK_EXT}", k_size), io.BytesIO(mask_payload))
        self.entries.append(IndexEntry(key, t_off, len(payload), m_off, len(meta), k_off, k_size))
        self.block_tokens.append(n)
        self.documents += len(doc_ids)
        self.tokens += n
        return key

    @property
    def bytes_written(self) -> int:
        return self._hw.tell()

    def index_text(self) -> str:
        lines = [f"v1.2 {len(self.entries)}"]
        for e in self.entries:
            # DALI's v1.2 index holds data offsets; IndexEntry keeps header offsets (one block before).
            line = (f"{TOKENS_EXT} {e.tokens_offset + TAR_BLOCK} {e.tokens_size} {e.key}.{TOKENS_EXT} "
                    f"{META_EXT} {e.meta_offset + TAR_BLOCK} {e.meta_size} {e.key}.{META_EXT}")
            if e.mask_offset >= 0:
                line += f" {MASK_EXT} {e.mask_offset + TAR_BLOCK} {e.mask_size} {e.key}.{MASK_EXT}"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def close(self) -> dict:
        """Finish the tar, publish index then shard, and return the manifest's record of it."""
        if self._closed:
            raise RuntimeError(f"{self.url}: shard already closed")
        if not self.entries:
            self.abort()
            raise ValueError(f"{self.url}: refusing to write an empty shard")
        self._tar.close()
        self._closed = True
        size, digest = self._hw.tell(), self._hw.sha.hexdigest()
        atomic.write_bytes(self.url + INDEX_SUFFIX, self.index_text().encode())
        self._out.commit()
        return {"sha256": digest, "bytes": size, "blocks": len(self.entries),
                "documents": self.documents, "tokens": self.tokens, "block_tokens": list(self.block_tokens)}

    def abort(self) -> None:
        self._closed = True
        self._out.abort()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


