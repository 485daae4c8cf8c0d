"""Packing: turn a batch's (source, cursor) pairs into rows of seq_len + 1 tokens from decoded blocks.

`plan` resolves all rows to block slices at once (vectorized) and `acquire` takes block references
(so prefetching starts); `assemble` copies the slices into one int64 array and drops the references.
Under the `quarantine` policy a row that touches a corrupt block is replaced by the same source position
in the next epoch (k + n_seq, k + 2 n_seq, ...) whose blocks decode: a pure function of the data, so
every rank (and a rerun) makes the same choice without talking to the others.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from storage.loader.order import SourceOrder
from storage.loader.prefetch import BlockId, BlockStore, block_id, split_id
from storage.shards import ShardError

log = logging.getLogger(__name__)


@dataclass
class Plan:
    batch: int            # loader-local batch number
    srcs: np.ndarray      # source of each row
    curs: np.ndarray      # cursor (draw number within its source) of each row
    row: np.ndarray       # per block slice: its row,
    bid: np.ndarray       # block id,
    start: np.ndarray     # first token in the block,
    stop: np.ndarray      # stop token in the block,
    dst: np.ndarray       # and offset within the row
    blocks: np.ndarray    # distinct block ids ...
    uses: np.ndarray      # ... and the references each takes


def plan(first: int, srcs: np.ndarray, curs: np.ndarray, rows: int, orders: list[SourceOrder]) -> list[Plan]:
    """Plans of batches first, first + 1, ... whose rows (`rows` each) are srcs/curs, resolved in one pass
    (the numpy calls cost the same for one batch or many)."""
    parts = []
    for s in np.unique(srcs):
        idx = np.flatnonzero(srcs == s)
        which, b, a, z, d = orders[int(s)].locate(curs[idx])
        parts.append((idx[which], (int(s) << 40) | b, a, z, d))
    grow, bid, start, stop, dst = (np.concatenate(x) for x in zip(*parts))
    order = np.argsort(grow // rows, kind="stable")
    grow, bid, start, stop, dst = grow[order], bid[order], start[order], stop[order], dst[order]
    n_batches = len(srcs) // rows
    cuts = np.searchsorted(grow, np.arange(n_batches + 1) * rows)
    plans = []
    for i in range(n_batches):
        sl, rs = slice(cuts[i], cuts[i + 1]), slice(i * rows, (i + 1) * rows)
        blocks, uses = np.unique(bid[sl], return_counts=True)
        plans.append(Plan(first + i, srcs[rs], curs[rs], grow[sl] - i * rows, bid[sl], start[sl], stop[sl],
                          dst[sl], blocks, uses))
    return plans


def acquire(p: Plan, store: BlockStore) -> None:
    store.acquire(p.blocks.tolist(), p.uses.tolist())


def release(p: Plan, store: BlockStore) -> None:
    store.release(p.blocks.tolist(), p.uses.tolist())


class Packer:
    def __init__(self, orders: list[SourceOrder], store: BlockStore, seq_len: int, policy: str,
                 max_substitutes: int):
        self.orders, self.store, self.width = orders, store, seq_len + 1
        self.policy, self.max_substitutes = policy, max_substitutes
        self.substituted = 0

    def assemble(self, p: Plan) -> np.ndarray:
        out = np.empty((len(p.srcs), self.width), dtype=np.int64)
        bad_rows: set[int] = set()
        try:
            order = np.argsort(p.bid, kind="stable")
            bids, rows, starts, stops, dsts = (x[order].tolist() for x in (p.bid, p.row, p.start, p.stop, p.dst))
            cur, tokens = -1, None
            for bid, r, a, z, d in zip(bids, rows, starts, stops, dsts):
                if bid != cur:
                    cur = bid
                    try:
                        tokens = self.store.get(bid)
                    except ShardError as e:
                        if self.policy != "quarantine":
                            raise
                        self._mark_bad(bid, e)
                        tokens = None
                if tokens is None:
                    bad_rows.add(r)
                else:
                    out[r, d:d + z - a] = tokens[a:z]
            for r in sorted(bad_rows):
                self._substitute(out[r], int(p.srcs[r]), int(p.curs[r]))
        finally:
            release(p, self.store)
        return out

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
