"""Packing: turn a batch's (source, cursor) pairs into rows of seq_len + 1 tokens from decoded blocks.

`plan` resolves a chunk of batches to block slices at once (vectorized) and `acquire` takes the chunk's
block references (so prefetching starts); `assemble` copies one batch's slices into one int64 array, and
the chunk's references drop after its last batch.
Under the `quarantine` policy a row that touches a corrupt block is replaced by the same source position
in the next epoch (k + n_seq, k + 2 n_seq, ...) whose blocks decode: a pure function of the data, so
every rank (and a rerun) makes the same choice without talking to the others.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from storage.loader.order import SourceOrder, distinct_values
from storage.loader.prefetch import BlockId, BlockStore, block_id, split_id
from storage.shards import ShardError

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """One batch resolved to block slices. Pieces are in output order (row-major), so their
    concatenation is the batch; the hot fields are Python lists, read once per batch."""
    batch: int            # loader-local batch number
    srcs: np.ndarray      # source of each row
    curs: np.ndarray      # cursor (draw number within its source) of each row
    chunk: Chunk          # the chunk holding this batch's block references
    blocks: list[int]     # the blocks this batch reads, as indices into chunk.blocks
    piece_block: list[int]  # per piece: index into chunk.blocks,
    start: list[int]      # first token in the block,
    stop: list[int]       # stop token in the block,
    row: np.ndarray       # and its row among the rows this plan fills (for the quarantine path)
    rows_out: np.ndarray | None = None  # the batch rows this plan fills, ascending; None: all of them


@dataclass
class Chunk:
    """Consecutive batches planned together. They hold one reference on every block any of them reads,
    taken before the first is built and dropped after the last, so the per-block bookkeeping (reference
    counts, waiting for the read, the decoded array) is paid once per chunk instead of once per batch:
    with the window shuffle every batch reads ~20 blocks, and most of them again in the next batch.
    Plans point to their chunk, never the reverse, so a built chunk is freed at once (no cycle for the
    garbage collector, whose full passes over a large training process stall the loader thread)."""
    blocks: list[BlockId]  # distinct blocks, in the order of their first use
    srcs: np.ndarray      # source and cursor of every row of every batch, in order
    curs: np.ndarray
    tokens: list = field(default_factory=list)  # per block: None until fetched, then its tokens or BAD
    pending: int = 0      # batches not yet built; the references drop when it reaches 0


BAD = np.empty(0, dtype=np.int64)  # stands for a corrupt block in Chunk.tokens (quarantine policy)


def plan(first: int, srcs: np.ndarray, curs: np.ndarray, rows: int, orders: list[SourceOrder],
         part: tuple[int, int] | None = None) -> list[Plan]:
    """Plans of batches first, first + 1, ... (one chunk) whose rows (`rows` each) are srcs/curs, resolved
    in one vectorized pass. `part` = (p, n): only the rows from the p-th of n stretches of their shuffle window
    (SourceOrder.part_of), so n worker processes share each batch and each reads ~1/n of the blocks."""
    parts = [(np.empty(0, np.int64),) * 5]
    for s in distinct_values(srcs):
        idx = np.flatnonzero(srcs == s)
        if part is not None:
            idx = idx[orders[int(s)].part_of(curs[idx], part[1]) == part[0]]
        which, b, a, z, d = orders[int(s)].locate(curs[idx])
        parts.append((idx[which], (int(s) << 40) | b, a, z, d))
    grow, bid, start, stop, dst = (np.concatenate(x) for x in zip(*parts))
    if len(parts) > 2:  # several sources: merge their pieces into row-major output order (one source's
        order = np.lexsort((dst, grow))  # pieces come out of locate in that order already)
        grow, bid, start, stop = grow[order], bid[order], start[order], stop[order]
    n_batches = len(srcs) // rows
    batch = grow // rows
    # distinct blocks in the order the batches first need them (reads are queued in that order, so the
    # first batch does not wait for the chunk's last block), and each piece's index among them
    by_value = np.argsort(bid, kind="stable")
    group = _run_starts(bid[by_value])
    first_use = by_value[group]  # stable: the first piece of each block
    by_use = np.argsort(first_use)
    rank = np.empty_like(by_use)
    rank[by_use] = np.arange(len(by_use))
    dense = np.empty_like(by_value)
    dense[by_value] = rank[np.cumsum(group) - 1]
    distinct = bid[first_use[by_use]]
    nd = max(1, len(distinct))
    # each batch's distinct blocks: distinct (batch, block) pairs, in ascending order
    pair = np.sort(batch * nd + dense)
    pair = pair[_run_starts(pair)]
    pair_cut = np.searchsorted(pair, np.arange(n_batches + 1) * nd).tolist()
    piece_cut = np.searchsorted(batch, np.arange(n_batches + 1)).tolist()
    pair_block, dense_l, start_l, stop_l = (pair % nd).tolist(), dense.tolist(), start.tolist(), stop.tolist()
    row_in_batch = grow - batch * rows
    chunk, plans = Chunk(distinct.tolist(), srcs, curs, [None] * len(distinct), n_batches), []
    if part is not None:  # the rows this worker fills, per batch, and each piece's index among them
        own = np.unique(grow)
        own_cut = np.searchsorted(own, np.arange(n_batches + 1) * rows)
        own_pos = np.searchsorted(own, grow)
    for i in range(n_batches):
        p0, p1, rs = piece_cut[i], piece_cut[i + 1], slice(i * rows, (i + 1) * rows)
        row, rows_out = row_in_batch[p0:p1], None
        if part is not None:
            rows_out = own[own_cut[i]:own_cut[i + 1]] - i * rows
            row = own_pos[p0:p1] - own_cut[i]
        plans.append(Plan(first + i, srcs[rs], curs[rs], chunk, pair_block[pair_cut[i]:pair_cut[i + 1]],
                          dense_l[p0:p1], start_l[p0:p1], stop_l[p0:p1], row, rows_out))
    return plans


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

    def assemble(self, p: Plan, out: np.ndarray | None = None) -> np.ndarray:
        """Batch `p` as int64 [rows, seq_len + 1], written into `out` when given (a plan of part of the
        rows writes only those rows)."""
        c = p.chunk
        if out is None:
            out = np.empty((len(p.srcs), self.width), dtype=np.int64)
        dst = out
        if p.rows_out is not None:  # its rows are scattered: build them together, then place them
            if len(self._scratch) < out.size:
                self._scratch = np.empty(out.size, dtype=np.int64)
            dst = self._scratch[:len(p.rows_out) * self.width].reshape(-1, self.width)
        try:
            tokens, bad = c.tokens, False
            for i in p.blocks:
                t = tokens[i]
                if t is None:
                    t = tokens[i] = self._get(c.blocks[i])
                bad = bad or t is BAD
            if not bad and p.start:  # one C call copies (and widens) every piece into place
                np.concatenate([tokens[i][a:z] for i, a, z in zip(p.piece_block, p.start, p.stop)],
                               out=dst.reshape(-1))
            elif bad:
                self._assemble_around_bad(p, tokens, dst)
            if p.rows_out is not None:
                out[p.rows_out] = dst
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
        """`out`: the rows this plan fills (p.row indexes them)."""
        flat, pos, bad_rows = out.reshape(-1), 0, set()
        for i, a, z, r in zip(p.piece_block, p.start, p.stop, p.row.tolist()):
            if tokens[i] is BAD:
                bad_rows.add(r)
            else:
                flat[pos:pos + z - a] = tokens[i][a:z]
            pos += z - a
        for r in sorted(bad_rows):
            b = r if p.rows_out is None else int(p.rows_out[r])
            self._substitute(out[r], int(p.srcs[b]), int(p.curs[b]))

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
