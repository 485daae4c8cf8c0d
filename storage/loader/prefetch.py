"""Block prefetching: a bounded thread pool reads, verifies and LZ4-decodes blocks ahead of use.

Blocks are reference-counted by the planner (one reference per planned sequence that needs the
block). A block whose references reach zero stays cached (least recently used first out), because the
window shuffle brings the rest of its sequences back a few hundred sequences later; cached blocks are
evicted whenever the bytes held would exceed the budget. Bytes (compressed + decoded, per block) are
known at request time from the index and the manifest, so the planner stays under its budget before it
asks. Blocks decode into the slots of one arena (a shared anonymous mapping, made lazily by the process
that uses it, so the decode processes it forks write into it too), recycled last-freed first: a long run
stops paying the kernel for fresh pages, and since every block lies in the same mapping at a known
offset, the packer gathers a batch's rows with one indexing call (`Packer.assemble`). Reads go through
ShardReader (memory-mapped locally, fsspec range reads with retries remotely); the checksum and the
decode run in the pool threads without the GIL (`storage.codec`). With `threads=0` there is no pool: a
block is read and decoded by the thread that first asks for it (what a batch-building worker process
does with a local dataset, where a second thread would only pass the GIL back and forth).
"""
from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from storage.loader.decoders import DecoderPool, Pending
from storage.shards import TAR_BLOCK, ShardError, ShardReader, decode_tokens

BlockId = int  # source index << 40 | block number within the source
_SHIFT = 40


def block_id(source: int, block: int) -> BlockId:
    return (source << _SHIFT) | block


def split_id(bid: BlockId) -> tuple[int, int]:
    return bid >> _SHIFT, bid & ((1 << _SHIFT) - 1)


@dataclass
class _Entry:
    future: Future | Pending | None  # None without a pool or decoders: loaded on first get()
    refs: int
    nbytes: int
    tokens: np.ndarray | None = None
    slot: int = -1  # the arena slot the tokens live in; -1: a private buffer (the arena was full)


class BlockStore:
    def __init__(self, refs: list[list[tuple[ShardReader, int]]], block_tokens: list[np.ndarray],
                 itemsize: int, threads: int, max_bytes: int, reader=None):
        """`refs[s][b]` = (shard reader, block index in that shard) of block b of source s; `reader`
        (optional) replaces ShardReader.read_raw, e.g. with DALI's; `threads=0`: load in the asking thread."""
        self.refs, self.block_tokens, self.itemsize = refs, block_tokens, itemsize
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="smoltrain-prefetch") \
            if threads else None
        self._read_raw = reader or (lambda sh, k: sh.read_raw(k, zero_copy=True))
        self.max_bytes = max_bytes
        self._entries: dict[BlockId, _Entry] = {}
        self._idle: OrderedDict[BlockId, None] = OrderedDict()  # cached, unreferenced blocks, LRU first
        self.bytes_idle = 0
        self._lock = threading.Lock()
        self.bytes_in_flight = 0
        self.peak_bytes_in_flight = 0
        self.bytes_read = 0
        self.blocks_read = 0
        self.bad: dict[BlockId, ShardError] = {}
        self._buf_tokens = 0  # tokens per decode buffer: the largest block of any source
        self._arena: np.ndarray | None = None  # [slots, tokens per slot]; see arena()
        self._arena_pid = 0
        self._arena_lock = threading.Lock()
        self.free_slots: list[int] = []  # arena slots holding no block (pop/append are atomic)
        self.decoder: DecoderPool | None = None  # decode processes, when use_decoders() was called

    def use_decoders(self, processes: int) -> None:
        """From now on, blocks are read and decoded by `processes` forked processes (storage.loader.decoders)
        into the arena."""
        self.arena()
        self.decoder = DecoderPool(self, processes)

    def arena(self) -> np.ndarray:
        """The decode arena [slots, tokens per slot] of this process: room for the byte budget's worth of
        the largest block (64 to 4096 slots; when all hold blocks, a block decodes into a private buffer).
        Made on first use by each process (a forked worker makes its own: sharing its parent's would mix
        their blocks); pages cost nothing until a block first lands in them."""
        if self._arena_pid != os.getpid():
            with self._arena_lock:
                if self._arena_pid != os.getpid():
                    width = max(self.buffer_tokens(), 4096 // self.itemsize)  # room for an error message
                    slots = min(4096, max(64, self.max_bytes // (self.buffer_tokens() * self.itemsize) + 16))
                    mem = mmap.mmap(-1, slots * width * self.itemsize)
                    self._arena = np.frombuffer(mem, dtype=f"<u{self.itemsize}").reshape(slots, width)
                    self.free_slots = list(range(slots - 1, -1, -1))
                    self._arena_pid = os.getpid()
        return self._arena

    def take_slot(self) -> int:
        """A free arena slot, or -1 when every slot holds a block."""
        self.arena()
        try:
            return self.free_slots.pop()
        except IndexError:
            return -1

    def offset(self, bid: BlockId) -> int:
        """Where a fetched block's tokens start in the flattened arena, or -1 (a private buffer)."""
        slot = self._entries[bid].slot
        return slot * self._arena.shape[1] if slot >= 0 else -1

    def count_read(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.blocks_read += 1

    def cost(self, bid: BlockId) -> int:
        """Bytes a block occupies while in flight: its compressed span plus its decoded tokens."""
        s, b = split_id(bid)
        sh, k = self.refs[s][b]
        return sh.index[k].span[1] + int(self.block_tokens[s][b]) * self.itemsize

    def new_cost(self, bids) -> int:
        """Bytes that referencing `bids` would add to the referenced (non-evictable) bytes."""
        with self._lock:
            return sum(self.cost(b) if b not in self._entries else (self._entries[b].nbytes if b in self._idle else 0)
                       for b in set(bids))

    @property
    def bytes_referenced(self) -> int:
        return self.bytes_in_flight - self.bytes_idle

    def acquire(self, bids: list[BlockId], uses: list[int]) -> None:
        """Take `uses[i]` references on block bids[i], submitting reads for blocks not held yet."""
        with self._lock:
            for bid, n in zip(bids, uses):
                e = self._entries.get(bid)
                if e is None:
                    nbytes = self.cost(bid)
                    self._evict(nbytes)
                    future = self.decoder.submit(bid) if self.decoder else \
                        self.pool.submit(self._load, bid) if self.pool else None
                    e = self._entries[bid] = _Entry(future, 0, nbytes)
                    self.bytes_in_flight += nbytes
                    self.peak_bytes_in_flight = max(self.peak_bytes_in_flight, self.bytes_in_flight)
                elif bid in self._idle:
                    del self._idle[bid]
                    self.bytes_idle -= e.nbytes
                e.refs += n

    def _evict(self, incoming: int) -> None:
        while self._idle and self.bytes_in_flight + incoming > self.max_bytes:
            self._drop(next(iter(self._idle)))

    def sweep(self, done, patience: int = 16) -> None:
        """Recycle cached blocks for which `done(bid)` says no planned reader needs them again this epoch,
        oldest first, giving up after `patience` blocks that are still needed (blocks finish in roughly
        LRU order; the bound keeps this O(1) per batch). Keeps the cache near the shuffle window's
        working set instead of the whole budget."""
        with self._lock:
            for bid in list(itertools.islice(self._idle, 4 * patience)):
                if done(bid):
                    self._drop(bid)
                else:
                    patience -= 1
                    if not patience:
                        return

    def _drop(self, bid: BlockId) -> None:
        """Forget an idle block (lock held); its buffer takes a later block."""
        del self._idle[bid]
        e = self._entries.pop(bid)
        self.bytes_idle -= e.nbytes
        self.bytes_in_flight -= e.nbytes
        if self.decoder is not None and e.future is not None:
            self.decoder.free(e.future)  # its slot, once the decode finished
        elif e.tokens is not None:
            if e.slot >= 0:
                self.free_slots.append(e.slot)
        elif e.future is not None:  # never fetched (a cancelled plan): its slot once the read is done
            e.future.add_done_callback(self._free_slot_of)

    def _free_slot_of(self, f: Future) -> None:
        if not f.cancelled() and f.exception() is None and f.result()[1] >= 0:
            self.free_slots.append(f.result()[1])

    def get(self, bid: BlockId) -> np.ndarray:
        """The block's tokens (waits for its read); raises ShardError for a corrupt block."""
        e = self._entries[bid]
        if e.tokens is None:
            e.tokens, e.slot = e.future.result() if e.future else self._load(bid)
        return e.tokens

    def release(self, bids: list[BlockId], uses: list[int]) -> None:
        with self._lock:
            for bid, n in zip(bids, uses):
                e = self._entries[bid]
                e.refs -= n
                if e.refs <= 0:
                    self._idle[bid] = None
                    self.bytes_idle += e.nbytes
            self._evict(0)

    def load_now(self, bid: BlockId) -> np.ndarray:
        """Read a block outside the reference counting (quarantine stand-ins); raises ShardError."""
        if bid in self.bad:
            raise self.bad[bid]
        return self._load(bid, False)[0]

    def read_decode(self, bid: BlockId, out: np.ndarray) -> tuple[np.ndarray, int]:
        """Read, verify and decode block `bid` into `out`: (its tokens, bytes read). Raises ShardError."""
        s, b = split_id(bid)
        sh, k = self.refs[s][b]
        entry = sh.index[k]
        try:
            payload, meta = self._read_raw(sh, k)
        except FileNotFoundError as e:
            raise ShardError(sh.url, f"shard is missing ({e})", f"{entry.key}.tokens.lz4", entry.tokens_offset) \
                from None
        try:
            tokens = decode_tokens(sh.url, entry.key, payload, meta, entry.tokens_offset, out)
            want = int(self.block_tokens[s][b])
            if len(tokens) != want:
                raise ShardError(sh.url, f"block has {len(tokens)} tokens, the manifest says {want}",
                                 f"{entry.key}.tokens.lz4", entry.tokens_offset)
        finally:
            sh.release(k)
        return tokens, len(payload) + len(meta) + 2 * TAR_BLOCK

    def buffer_tokens(self) -> int:
        """Tokens of the largest block of any source: the size of every decode buffer."""
        if not self._buf_tokens:
            self._buf_tokens = max(int(t.max()) for t in self.block_tokens if len(t))
        return self._buf_tokens

    def _load(self, bid: BlockId, pooled: bool = True) -> tuple[np.ndarray, int]:
        """(tokens, the arena slot holding them or -1); `pooled=False`: into a private buffer."""
        slot = self.take_slot() if pooled else -1
        buf = self._arena[slot] if slot >= 0 else np.empty(self.buffer_tokens(), dtype=f"<u{self.itemsize}")
        try:
            tokens, nbytes = self.read_decode(bid, buf)
        except ShardError:
            if slot >= 0:
                self.free_slots.append(slot)
            raise
        self.count_read(nbytes)
        return tokens, slot

    def map(self, fn, items) -> list:
        """fn over items, on the pool when there is one (many small reads of a remote dataset)."""
        return list(self.pool.map(fn, items) if self.pool else map(fn, items))

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.decoder:
            self.decoder.close()
            self.decoder = None
        with self._lock:
            self._entries.clear()
            self._idle.clear()
            self.free_slots = list(range(len(self._arena) - 1, -1, -1)) if self._arena is not None else []
            self.bytes_in_flight = self.bytes_idle = 0
