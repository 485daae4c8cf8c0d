"""Block prefetching: a bounded thread pool reads, verifies and LZ4-decodes blocks ahead of use.

Blocks are reference-counted by the planner (one reference per sequence that needs the block), so a
block is read once however many sequences it feeds, and dropped when the last of them is packed.
Bytes in flight (compressed + decoded bytes of every block requested and not yet dropped) are accounted
at request time from the index and the manifest, so the planner can stay under its budget before it
asks. Reads go through ShardReader (pread locally, fsspec range reads with retries remotely); the
decode runs in the pool threads (python-lz4 releases the GIL).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from storage.shards import TAR_BLOCK, ShardError, ShardReader, decode_block

BlockId = tuple[int, int]  # (source index, block number within the source)


@dataclass
class _Entry:
    future: Future
    refs: int
    nbytes: int


class BlockStore:
    def __init__(self, refs: list[list[tuple[ShardReader, int]]], block_tokens: list[np.ndarray],
                 itemsize: int, threads: int, reader=None):
        """`refs[s][b]` = (shard reader, block index in that shard) of block b of source s; `reader`
        (optional) replaces ShardReader.read_raw, e.g. with DALI's."""
        self.refs, self.block_tokens, self.itemsize = refs, block_tokens, itemsize
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="smoltrain-prefetch")
        self._read_raw = reader or (lambda sh, k: sh.read_raw(k))
        self._entries: dict[BlockId, _Entry] = {}
        self._lock = threading.Lock()
        self.bytes_in_flight = 0
        self.bytes_read = 0
        self.blocks_read = 0
        self.bad: dict[BlockId, ShardError] = {}

    def cost(self, bid: BlockId) -> int:
        """Bytes a block occupies while in flight: its compressed span plus its decoded tokens."""
        sh, k = self.refs[bid[0]][bid[1]]
        return sh.index[k].span[1] + int(self.block_tokens[bid[0]][bid[1]]) * self.itemsize

    def new_cost(self, bids) -> int:
        with self._lock:
            return sum(self.cost(b) for b in set(bids) if b not in self._entries)

    def acquire(self, bid: BlockId, n: int = 1) -> None:
        with self._lock:
            e = self._entries.get(bid)
            if e is None:
                nbytes = self.cost(bid)
                e = self._entries[bid] = _Entry(self.pool.submit(self._load, bid), 0, nbytes)
                self.bytes_in_flight += nbytes
            e.refs += n

    def get(self, bid: BlockId) -> np.ndarray:
        """The block's tokens (waits for its read); raises ShardError for a corrupt block."""
        return self._entries[bid].future.result()

    def release(self, bid: BlockId, n: int = 1) -> None:
        with self._lock:
            e = self._entries[bid]
            e.refs -= n
            if e.refs <= 0:
                del self._entries[bid]
                self.bytes_in_flight -= e.nbytes

    def load_now(self, bid: BlockId) -> np.ndarray:
        """Read a block outside the reference counting (quarantine stand-ins); raises ShardError."""
        if bid in self.bad:
            raise self.bad[bid]
        return self.pool.submit(self._load, bid).result()

    def _load(self, bid: BlockId) -> np.ndarray:
        sh, k = self.refs[bid[0]][bid[1]]
        entry = sh.index[k]
        try:
            payload, meta = self._read_raw(sh, k)
        except FileNotFoundError as e:
            raise ShardError(sh.url, f"shard is missing ({e})", f"{entry.key}.tokens.lz4", entry.tokens_offset) \
                from None
        with self._lock:
            self.bytes_read += len(payload) + len(meta) + 2 * TAR_BLOCK
            self.blocks_read += 1
        block = decode_block(sh.url, entry.key, payload, meta, entry.tokens_offset)
        want = int(self.block_tokens[bid[0]][bid[1]])
        if len(block.tokens) != want:
            raise ShardError(sh.url, f"block has {len(block.tokens)} tokens, the manifest says {want}",
                             f"{entry.key}.tokens.lz4", entry.tokens_offset)
        return block.tokens

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._entries.clear()
            self.bytes_in_flight = 0
