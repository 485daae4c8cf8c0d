"""Write one source's documents into blocks and shards of format v1 (or v2: conversations with loss
masks); open a dataset for reading; read documents back in order (`iter_documents`, e.g. a source's
held-out validation shards)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from storage import fs
from storage.manifest import Manifest, ShardInfo, SourceInfo, read_manifest
from storage.shard_writer import ShardWriter
from storage.shards import ShardReader, parse_dtype


VALIDATION_PREFIX = "validation"


def shard_relpath(source: str, index: int, prefix: str = "", task: int | None = None) -> str:
    """`SOURCE/shard-NNNNNN.tar`, or `SOURCE/shard-TTTTT-NNNN.tar` for the shards written by build task
    TTTTT; under `PREFIX/` with a prefix."""
    path = f"{source}/shard-{index:06d}.tar" if task is None else f"{source}/shard-{task:05d}-{index:04d}.tar"
    return f"{prefix.strip('/')}/{path}" if prefix else path


class SourceWriter:
    """Packs whole documents (token arrays ending in EOS) into blocks of ~`block_tokens` tokens and
    rolls to a new shard after `shard_blocks` blocks. A document longer than a block gets a block
    of its own. With `prefix` the shards go to `PREFIX/SOURCE/` (e.g. the held-out validation split).
    Documents given with a loss mask (conversations) make format 2 blocks and a source of kind "chat"
    (or `kind`, e.g. "preference"); a source's documents all have masks or none do. `add_group` adds
    documents that must share a block (a preference pair's two sides). `close()` returns the source's
    manifest entry. With `task`, shard names carry the build task that wrote them (`shard_relpath`).
    `meta` gives each document of a group a JSON object (a prompt's answer), written as the block JSON's
    `doc_meta`; like masks, a source's documents all have one or none do."""

    def __init__(self, dataset: str, source: str, dtype: str, block_tokens: int = 262_144,
                 shard_blocks: int = 64, first_shard: int = 0, prefix: str = "", kind: str | None = None,
                 task: int | None = None):
        if block_tokens <= 0 or shard_blocks <= 0:
            raise ValueError("block_tokens and shard_blocks must be > 0")
        self.dataset, self.source, self.dtype, self.prefix = dataset, source, parse_dtype(dtype), prefix
        self.block_tokens, self.shard_blocks = block_tokens, shard_blocks
        self.info = SourceInfo()
        self._next_shard = first_shard
        self._writer: ShardWriter | None = None
        self._relpath = ""
        self._docs: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._ids: list[str] = []
        self._meta: list[dict] = []
        self._pending = 0
        self._masked: bool | None = None  # set by the first document
        self._with_meta: bool | None = None  # set by the first group
        self._kind = kind
        self._task = task

    def add_document(self, doc_id: str, tokens: np.ndarray, mask: np.ndarray | None = None,
                     meta: dict | None = None) -> None:
        self.add_group([(doc_id, tokens, mask)], None if meta is None else [meta])

    def add_group(self, docs, meta: list[dict] | None = None) -> None:
        """Add `docs`, a sequence of (doc_id, tokens, mask or None), to one block: the block being filled
        when they all fit in it, else a new one (a group longer than a block gets a block of its own).
        `meta`: one JSON object per document, or None."""
        if self._with_meta is None:
            self._with_meta = meta is not None
        elif self._with_meta != (meta is not None):
            raise ValueError(f"documents {docs[0][0]!r}...: a source's documents must all have metadata or none")
        if meta is not None and len(meta) != len(docs):
            raise ValueError(f"documents {docs[0][0]!r}...: {len(meta)} metadata objects for {len(docs)} documents")
        for doc_id, tokens, mask in docs:
            if len(tokens) == 0:
                raise ValueError(f"document {doc_id!r} has no tokens (EOS must be appended)")
            if self._masked is None:
                self._masked = mask is not None
                self.info.kind = self._kind or ("chat" if self._masked else "text")
            elif self._masked != (mask is not None):
                raise ValueError(f"document {doc_id!r}: a source's documents must all have a loss mask or none")
            if mask is not None and len(mask) != len(tokens):
                raise ValueError(f"document {doc_id!r}: mask has {len(mask)} entries for {len(tokens)} tokens")
        n = sum(len(t) for _, t, _ in docs)
        if self._pending and self._pending + n > self.block_tokens:
            self._flush_block()
        for doc_id, tokens, mask in docs:
            if mask is not None:
                self._masks.append(np.asarray(mask, dtype=np.uint8))
            self._docs.append(np.asarray(tokens))
            self._ids.append(str(doc_id))
        if meta is not None:
            self._meta.extend(meta)
        self._pending += n
        if self._pending >= self.block_tokens:
            self._flush_block()

    def add_documents(self, tokens: np.ndarray, docs: list[tuple[str, int, int]],
                      meta: list[dict] | None = None) -> None:
        """Add documents without masks that lie in `tokens`, given as (doc_id, offset, length), with one
        metadata object each or none: the same blocks as `add_document` for each in turn, for a batch at once."""
        if docs and self._masked is None:
            self._masked = False
            self.info.kind = self._kind or "text"
        if docs and self._masked:
            raise ValueError(f"document {docs[0][0]!r}: a source's documents must all have a loss mask or none")
        if docs and self._with_meta is None:
            self._with_meta = meta is not None
        elif docs and self._with_meta != (meta is not None):
            raise ValueError(f"document {docs[0][0]!r}: a source's documents must all have metadata or none")
        for k, (doc_id, off, n) in enumerate(docs):
            if n <= 0:
                raise ValueError(f"document {doc_id!r} has no tokens (EOS must be appended)")
            if self._pending and self._pending + n > self.block_tokens:
                self._flush_block()
            self._docs.append(tokens[off:off + n])
            self._ids.append(str(doc_id))
            if meta is not None:
                self._meta.append(meta[k])
            self._pending += n
            if self._pending >= self.block_tokens:
                self._flush_block()

    def _flush_block(self) -> None:
        if not self._docs:
            return
        if self._writer is None:
            self._relpath = shard_relpath(self.source, self._next_shard, self.prefix, self._task)
            self._writer = ShardWriter(fs.join(self.dataset, self._relpath), self.dtype, self.source)
            self._next_shard += 1
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in self._docs])]).tolist()
        mask = np.concatenate(self._masks) if self._masked else None
        self._writer.add_block(np.concatenate(self._docs).astype(self.dtype, copy=False), self._ids, offsets, mask,
                               self._meta if self._with_meta else None)
        self._docs, self._masks, self._ids, self._meta, self._pending = [], [], [], [], 0
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
    """A dataset opened for reading: its manifest and one reader per shard (training shards in
    `readers`, held-out validation shards in `validation_readers`)."""
    url: str
    manifest: Manifest
    readers: dict[str, list[ShardReader]] = field(default_factory=dict)
    validation_readers: dict[str, list[ShardReader]] = field(default_factory=dict)

    @classmethod
    def open(cls, url: str) -> "Dataset":
        m = read_manifest(url)

        def open_all(sources: dict[str, SourceInfo]) -> dict[str, list[ShardReader]]:
            return {name: [ShardReader(fs.join(url, sh.path)) for sh in src.shards] for name, src in sources.items()}

        return cls(url, m, open_all(m.sources), open_all(m.validation))


def iter_documents(dataset_url: str, shard_infos: Iterable[ShardInfo], verify: bool = True,
                   with_mask: bool = False) -> Iterator[tuple]:
    """iter_documents(dataset_url: str, shard_infos: Iterable[ShardInfo], verify: bool = True,
    with_mask: bool = False) -> Iterator[tuple[str, np.ndarray]]

    Every document of the given shards (paths relative to `dataset_url`), in shard, block and document
    order, as `(doc_id, tokens)`; `tokens` (ending with EOS, for pretraining sources) is a view into its
    decoded block (copy it to keep it beyond the block). Blocks are range-read through each shard's index
    and checked (xxh3 of each block unless `verify=False`). For example, a source's held-out split:
    `iter_documents(url, read_manifest(url).validation["web"].shards)`. With `with_mask` it yields
    `(doc_id, tokens, mask)`, `mask` the document's uint8 loss mask (format 2 blocks) or None."""
    for sh in shard_infos:
        reader = ShardReader(fs.join(dataset_url, sh.path))
        try:
            for k in range(len(reader)):
                block = reader.read_block(k, verify=verify)
                offs = block.offsets
                for i, doc_id in enumerate(block.doc_ids):
                    if with_mask:
                        m = None if block.mask is None else block.mask[offs[i]:offs[i + 1]]
                        yield doc_id, block.tokens[offs[i]:offs[i + 1]], m
                    else:
                        yield doc_id, block.tokens[offs[i]:offs[i + 1]]
        finally:
            reader.close()
