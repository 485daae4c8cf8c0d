"""Packing: turn a batch's (source, cursor) pairs into rows of seq_len + 1 tokens from decoded blocks.

`plan_steps` resolves a chunk of batches to block slices (vectorized, in a few steps that the loader
spreads over the batches it hands out) and `acquire` takes the chunk's block references (so prefetching
starts); `assemble` copies one batch's slices into one int64 array, and the chunk's references drop
after its last batch. Blocks lie in the store's arena, so the rows that come whole from one block (all
but ~1 % at seq_len 2048 and 256k-token blocks) are gathered by one fancy index into a sliding-window
view of the flattened arena and widened by one assignment: about half the cost of slicing every piece
and concatenating them (docs/loader.md, "Packing").
Under the `quarantine` policy a row that touches a corrupt block is replaced by the same source position
in the next epoch (k + n_seq, k + 2 n_seq, ...) whose blocks decode: a pure function of the data, so
every rank (and a rerun) makes the same choice without talking to the others.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np

from storage.loader.order import SourceOrder, distinct_values
from storage.loader.prefetch import BlockId, BlockStore, block_id, split_id
from storage.shards import ShardError

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    """Consecutive batches planned together. They hold one reference on every block any of them reads,
    taken before the first is built and dropped after the last, so the per-block bookkeeping (reference
    counts, waiting for the read, the decoded array) is paid once per chunk instead of once per batch:
    with the window shuffle every batch reads ~20 blocks, and most of them again in the next batch.
    Per-batch fields are the chunk's arrays cut by `*_cut` (batch i: [cut[i], cut[i + 1])), sliced only
    when the batch is built. Plans point to their chunk, never the reverse, so a built chunk is freed at
    once (no cycle for the garbage collector, whose full passes over a large training process stall the
    loader thread)."""
    blocks: list[BlockId]  # distinct blocks, in the order of their first use
    srcs: np.ndarray      # source and cursor of every row of every batch, in order
    curs: np.ndarray
    rows: int             # rows per batch
    tokens: list          # per block: None until fetched, then its tokens or BAD
    pending: int          # batches not yet built; the references drop when it reaches 0
    offsets: np.ndarray   # per block: where its tokens start in the flattened arena (-1: not there)
    batch_blocks: list[int]  # per batch (cut by block_cut): the blocks it reads, as indices into blocks
    block_cut: list[int]
    piece_block: np.ndarray  # per piece, in output (row-major) order (cut by piece_cut): index into blocks,
    start: np.ndarray     # first token in the block,
    stop: np.ndarray      # stop token in the block,
    row: np.ndarray       # and its row among the rows its batch's plan fills
    piece_cut: list[int]
    whole_block: np.ndarray  # per row that lies whole in one block (cut by whole_cut): index into blocks,
    whole_start: np.ndarray  # its first token there,
    whole_row: np.ndarray  # and its row among the rows its batch's plan fills
    whole_cut: list[int]
    split: list[tuple[int, int, int, int]]  # pieces of the other rows (cut by split_cut): (block index,
    split_cut: list[int]  # start, stop, flat position among the rows its batch's plan fills)
    own: np.ndarray | None = None  # worker part: the global rows (of srcs) it fills, ascending (cut by own_cut)
    own_cut: np.ndarray | None = None
    outside: int = 0      # blocks fetched that are not in the arena (then batches take the slicing path)


class Plan:
    """Batch `i` of its chunk (loader-local batch number `batch`)."""
    __slots__ = ("batch", "chunk", "i")

    def __init__(self, batch: int, chunk: Chunk, i: int):
        self.batch, self.chunk, self.i = batch, chunk, i

    @property
    def rows_out(self) -> np.ndarray | None:
        """The batch rows this plan fills, ascending; None: all of them."""
        c, i = self.chunk, self.i
        return None if c.own is None else c.own[c.own_cut[i]:c.own_cut[i + 1]] - i * c.rows

    def srcs_curs(self, r: int) -> tuple[int, int]:
        """(source, cursor) of batch row r."""
        g = self.i * self.chunk.rows + r
        return int(self.chunk.srcs[g]), int(self.chunk.curs[g])


BAD = np.empty(0, dtype=np.int64)  # stands for a corrupt block in Chunk.tokens (quarantine policy)


def plan_steps(first: int, srcs: np.ndarray, curs: np.ndarray, rows: int, orders: list[SourceOrder],
               part: tuple[int, int] | None = None) -> Generator[None, None, list[Plan]]:
    """Plans of batches first, first + 1, ... (one chunk) whose rows (`rows` each) are srcs/curs, resolved
    vectorized, in a few steps (a generator that yields between them and returns the plans; see
    `finish`). `part` = (p, n): only the rows from the p-th of n stretches of their shuffle window
    (SourceOrder.part_of), so n worker processes share each batch and each reads ~1/n of the blocks."""
    parts = [(np.empty(0, np.int64),) * 5]
    for s in distinct_values(srcs):
        idx = np.flatnonzero(srcs == s)
        if part is not None:
            idx = idx[orders[int(s)].part_of(curs[idx], part[1]) == part[0]]
        which, b, a, z, d = orders[int(s)].locate(curs[idx])
        parts.append((idx[which], (int(s) << 40) | b, a, z, d))
        yield
    grow, bid, start, stop, dst = (np.concatenate(x) for x in zip(*parts))
    if len(parts) > 2:  # several sources: merge their pieces into row-major output order (one source's
        order = np.lexsort((dst, grow))  # pieces come out of locate in that order already)
        grow, bid, start, stop, dst = grow[order], bid[order], start[order], stop[order], dst[order]
    n_batches = len(srcs) // rows
    batch = grow // rows
    # distinct blocks in the order the batches first need them (reads are queued in that order, so the
    # first batch does not wait for the chunk's last block), and each piece's index among them
    by_value = np.argsort(bid, kind="stable")
    group = _run_starts(bid[by_value])
    first_use = by_value[group]  # stable: the first piece of each block
    yield
    by_use = np.argsort(first_use)
    rank = np.empty_like(by_use)
    rank[by_use] = np.arange(len(by_use))
    dense = np.empty_like(by_value)
    dense[by_value] = rank[np.cumsum(group) - 1]
    distinct = bid[first_use[by_use]]
    nd = max(1, len(distinct))
    yield
    # each batch's distinct blocks: distinct (batch, block) pairs, in ascending order
    pair = np.sort(batch * nd + dense)
    pair = pair[_run_starts(pair)]
    pair_cut = np.searchsorted(pair, np.arange(n_batches + 1) * nd).tolist()
    piece_cut = _cuts(batch, n_batches)
    yield
    row = grow - batch * rows  # each piece's row among the rows its plan fills
    own = own_cut = None
    if part is not None:  # the rows this worker fills, per batch, and each piece's index among them
        own = np.unique(grow)
        own_cut = np.searchsorted(own, np.arange(n_batches + 1) * rows)
        row = np.searchsorted(own, grow) - own_cut[batch]
    yield
    width = orders[0].seq_len + 1
    whole = stop - start == width
    w, o = np.flatnonzero(whole), np.flatnonzero(~whole)
    chunk = Chunk(distinct.tolist(), srcs, curs, rows, [None] * len(distinct), n_batches,
                  np.full(len(distinct), -1, dtype=np.int64), (pair % nd).tolist(), pair_cut,
                  dense, start, stop, row, piece_cut,
                  dense[w], start[w], row[w], _cuts(batch[w], n_batches),
                  list(zip(dense[o].tolist(), start[o].tolist(), stop[o].tolist(), (row[o] * width + dst[o]).tolist())),
                  _cuts(batch[o], n_batches), own, own_cut)
    return [Plan(first + i, chunk, i) for i in range(n_batches)]


def finish(steps: Generator[None, None, list[Plan]], at_most: int | None = None) -> list[Plan] | None:
    """Run a planning generator's next `at_most` steps (None: all); its plans once it is done, else None."""
    try:
        for _ in itertools.repeat(None) if at_most is None else range(at_most):
            next(steps)
    except StopIteration as done:
        return done.value
    return None


def _cuts(batch_of: np.ndarray, n_batches: int) -> list[int]:
    """Where each batch's run starts in an array sorted by batch (plus the end)."""
    return np.searchsorted(batch_of, np.arange(n_batches + 1)).tolist()


def _run_starts(sorted_values: np.ndarray) -> np.ndarray:
    """Mask of the first element of each run of equal values (in a sorted array)."""
    flag = np.empty(len(sorted_values), dtype=bool)
    flag[:1] = True
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=flag[1:])
    return flag


def acquire(c: Chunk, store: BlockStore) -> None:
    store.acquire(c.blocks, [1] * len(c.blocks))


def release(c: Chunk, store: BlockStore) -> None:
    """Drop the chunk's references (once, whether or not all its batches were built)."""
    if c.tokens is not None:
        c.tokens = None
        store.release(c.blocks, [1] * len(c.blocks))


class Packer:
    def __init__(self, orders: list[SourceOrder], store: BlockStore, seq_len: int, policy: str,
                 max_substitutes: int):
        self.orders, self.store, self.width = orders, store, seq_len + 1
        self.policy, self.max_substitutes = policy, max_substitutes
        self.substituted = 0
        self._scratch = np.empty(0, dtype=np.int64)
        self._windows: tuple[np.ndarray | None, np.ndarray | None] = (None, None)  # (arena, its row windows)

    def _rows_of(self, arena: np.ndarray) -> np.ndarray:
        """Every seq_len + 1 window of the flattened arena, as a view: rows[o] starts at flat offset o."""
        if self._windows[0] is not arena:
            self._windows = (arena, np.lib.stride_tricks.sliding_window_view(arena.reshape(-1), self.width))
        return self._windows[1]

    def assemble(self, p: Plan, out: np.ndarray | None = None) -> np.ndarray:
        """Batch `p` as int64 [rows, seq_len + 1], written into `out` when given (a plan of part of the
        rows writes only those rows)."""
        c, i = p.chunk, p.i
        if out is None:
            out = np.empty((c.rows, self.width), dtype=np.int64)
        dst, rows_out = out, p.rows_out
        if rows_out is not None:  # its rows are scattered: build them together, then place them
            if len(self._scratch) < out.size:
                self._scratch = np.empty(out.size, dtype=np.int64)
            dst = self._scratch[:len(rows_out) * self.width].reshape(-1, self.width)
        try:
            tokens, bad = c.tokens, False
            for k in c.batch_blocks[c.block_cut[i]:c.block_cut[i + 1]]:
                t = tokens[k]
                if t is None:
                    t = tokens[k] = self._get(c.blocks[k])
                    if t is not BAD:
                        c.offsets[k] = self.store.offset(c.blocks[k])
                        c.outside += c.offsets[k] < 0
                bad = bad or t is BAD
            p0, p1 = c.piece_cut[i], c.piece_cut[i + 1]
            if bad:
                self._assemble_around_bad(p, tokens, dst)
            elif p0 < p1 and not c.outside:
                w0, w1 = c.whole_cut[i], c.whole_cut[i + 1]
                whole = self._rows_of(self.store.arena())[c.offsets[c.whole_block[w0:w1]] + c.whole_start[w0:w1]]
                if w1 - w0 == len(dst):
                    dst[...] = whole
                else:
                    dst[c.whole_row[w0:w1]] = whole
                    flat = dst.reshape(-1)
                    for k, a, z, pos in c.split[c.split_cut[i]:c.split_cut[i + 1]]:
                        flat[pos:pos + z - a] = tokens[k][a:z]
            elif p0 < p1:  # one C call copies (and widens) every piece into place
                np.concatenate([tokens[k][a:z] for k, a, z in zip(c.piece_block[p0:p1].tolist(),
                                                                  c.start[p0:p1].tolist(), c.stop[p0:p1].tolist())],
                               out=dst.reshape(-1))
            if rows_out is not None:
                out[rows_out] = dst
        finally:
            c.pending -= 1
            if c.pending == 0:
                release(c, self.store)
        return out

    def _get(self, bid: BlockId) -> np.ndarray:
        """The block's tokens; BAD for a corrupt block under the quarantine policy."""
        try:
            return self.store.get(bid)
        except ShardError as e:
            if self.policy != "quarantine":
                raise
            self._mark_bad(bid, e)
            return BAD

    def _assemble_around_bad(self, p: Plan, tokens: list[np.ndarray], out: np.ndarray) -> None:
        """`out`: the rows this plan fills (chunk.row indexes them)."""
        c, p0, p1 = p.chunk, p.chunk.piece_cut[p.i], p.chunk.piece_cut[p.i + 1]
        flat, pos, bad_rows = out.reshape(-1), 0, set()
        for k, a, z, r in zip(*(x[p0:p1].tolist() for x in (c.piece_block, c.start, c.stop, c.row))):
            if tokens[k] is BAD:
                bad_rows.add(r)
            else:
                flat[pos:pos + z - a] = tokens[k][a:z]
            pos += z - a
        rows_out = p.rows_out
        for r in sorted(bad_rows):
            self._substitute(out[r], *p.srcs_curs(r if rows_out is None else int(rows_out[r])))

    def _mark_bad(self, bid: BlockId, err: ShardError) -> None:
        if bid not in self.store.bad:
            self.store.bad[bid] = err
            s, b = split_id(bid)
            log.warning("quarantined block %d of source %r: %s", b, self.orders[s].name, err)

    def _substitute(self, row: np.ndarray, s: int, k: int) -> None:
        order = self.orders[s]
        for j in range(1, self.max_substitutes + 1):
            pieces = order.pieces(k + j * order.n_seq)
            if any(block_id(s, b) in self.store.bad for b, _, _ in pieces):
                continue
            pos = 0
            try:
                for b, a, z in pieces:
                    row[pos:pos + z - a] = self.store.load_now(block_id(s, b))[a:z]
                    pos += z - a
            except ShardError as e:
                self._mark_bad(block_id(s, b), e)
                continue
            self.substituted += 1
            return
        raise ShardError(order.name, f"quarantine: no clean stand-in for sequence {k} within "
                         f"{self.max_substitutes} epochs (too many corrupt blocks?)")
