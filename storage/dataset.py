"""Write one source's documents into blocks and shards of format v1; open a dataset for reading."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from storage import fs
from storage.manifest import Manifest, ShardInfo, SourceInfo, read_manifest
from storage.shard_writer import ShardWriter
from storage.shards import ShardReader, parse_dtype


def shard_relpath(source: str, index: int) -> str:
    return f"{source}/shard-{index:06d}.tar"


class SourceWriter:
    """Packs whole documents (token arrays ending in EOS) into blocks of ~`block_tokens` tokens and
    rolls to a new shard after `shard_blocks` blocks. A document longer than a block gets a block
    of its own. `close()` returns the source's manifest entry."""

    def __init__(self, dataset: str, source: str, dtype: str, block_tokens: int = 262_144,
                 shard_blocks: int = 64, first_shard: int = 0):
        if block_tokens <= 0 or shard_blocks <= 0:
            raise ValueError("block_tokens and shard_blocks must be > 0")
        self.dataset, self.source, self.dtype = dataset, source, parse_dtype(dtype)
        self.block_tokens, self.shard_blocks = block_tokens, shard_blocks
        self.info = SourceInfo()
        self._next_shard = first_shard
        self._writer: ShardWriter | None = None
        self._relpath = ""
        self._docs: list[np.ndarray] = []
        self._ids: list[str] = []
        self._pending = 0

    def add_document(self, doc_id: str, tokens: np.ndarray) -> None:
        if len(tokens) == 0:
            raise ValueError(f"document {doc_id!r} has no tokens (EOS must be appended)")
        if self._pending and self._pending + len(tokens) > self.block_tokens:
            self._flush_block()
        self._docs.append(np.asarray(tokens))
        self._ids.append(str(doc_id))
        self._pending += len(tokens)
        if self._pending >= self.block_tokens:
            self._flush_block()

    def _flush_block(self) -> None:
        if not self._docs:
            return
        if self._writer is None:
            self._relpath = shard_relpath(self.source, self._next_shard)
            self._writer = ShardWriter(fs.join(self.dataset, self._relpath), self.dtype, self.source)
            self._next_shard += 1
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in self._docs])]).tolist()
        self._writer.add_block(np.concatenate(self._docs).astype(self.dtype, copy=False), self._ids, offsets)
        self._docs, self._ids, self._pending = [], [], 0
        if len(self._writer.entries) >= self.shard_blocks:
            self._close_shard()

    def _close_shard(self) -> None:
        assert self._writer is not None
        rec = self._writer.close()
        self.info.shards.append(ShardInfo(path=self._relpath, **rec))
        self.info.documents += rec["documents"]
        self.info.tokens += rec["tokens"]
        self._writer = None

    def close(self) -> SourceInfo:
        self._flush_block()
        if self._writer is not None:
            self._close_shard()
        return self.info

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


@dataclass
class Dataset:
    """A dataset opened for reading: its manifest and one reader per shard."""
    url: str
    manifest: Manifest
    readers: dict[str, list[ShardReader]] = field(default_factory=dict)

    @classmethod
    def open(cls, url: str) -> "Dataset":
        m = read_manifest(url)
        readers = {name: [ShardReader(fs.join(url, sh.path)) for sh in src.shards]
                   for name, src in m.sources.items()}
        return cls(url, m, readers)
