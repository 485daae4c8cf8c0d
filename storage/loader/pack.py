"""Packing: turn a batch's (source, cursor) pairs into rows of seq_len + 1 tokens from decoded blocks.

`plan` resolves each row to block slices and takes block references (so prefetching starts);
`assemble` copies the slices into one int64 array and drops the references. Under the `quarantine`
policy a row that touches a corrupt block is replaced by the same source position in the next epoch
(k + n_seq, k + 2 n_seq, ...) whose blocks decode: a pure function of the data, so every rank (and a
rerun) makes the same choice without talking to the others.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from storage.loader.order import Piece, SourceOrder
from storage.loader.prefetch import BlockId, BlockStore
from storage.shards import ShardError

log = logging.getLogger(__name__)


@dataclass
class Plan:
    batch: int                                   # loader-local batch number
    rows: list[tuple[int, int, list[Piece]]]     # (source, cursor, pieces) per row
    uses: Counter = field(default_factory=Counter)  # block → references taken


def plan(batch: int, srcs: np.ndarray, curs: np.ndarray, orders: list[SourceOrder]) -> Plan:
    p = Plan(batch, [])
    for s, k in zip(srcs.tolist(), curs.tolist()):
        pieces = orders[s].pieces(k)
        p.rows.append((s, k, pieces))
        for b, _, _ in pieces:
            p.uses[(s, b)] += 1
    return p


def acquire(p: Plan, store: BlockStore) -> None:
    for bid, n in p.uses.items():
        store.acquire(bid, n)


class Packer:
    def __init__(self, orders: list[SourceOrder], store: BlockStore, seq_len: int, policy: str,
                 max_substitutes: int):
        self.orders, self.store, self.width = orders, store, seq_len + 1
        self.policy, self.max_substitutes = policy, max_substitutes
        self.substituted = 0

    def assemble(self, p: Plan, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty((len(p.rows), self.width), dtype=np.int64)
        try:
            for r, (s, k, pieces) in enumerate(p.rows):
                try:
                    self._fill(out[r], s, pieces, self.store.get)
                except ShardError as e:
                    if self.policy != "quarantine":
                        raise
                    self._quarantine(s, pieces, e)
                    self._substitute(out[r], s, k)
        finally:
            for bid, n in p.uses.items():
                self.store.release(bid, n)
        return out

    @staticmethod
    def _fill(row: np.ndarray, s: int, pieces: list[Piece], get) -> None:
        pos = 0
        for b, a, z in pieces:
            row[pos:pos + z - a] = get((s, b))[a:z]
            pos += z - a

    def _quarantine(self, s: int, pieces: list[Piece], err: ShardError) -> None:
        for b, _, _ in pieces:
            bid = (s, b)
            if bid in self.store.bad:
                continue
            try:
                self.store.get(bid) if self._held(bid) else self.store.load_now(bid)
            except ShardError as e:
                self.store.bad[bid] = e
                log.warning("quarantined block %s of source %r: %s", b, self.orders[s].name, e)

    def _held(self, bid: BlockId) -> bool:
        return bid in self.store._entries

    def _substitute(self, row: np.ndarray, s: int, k: int) -> None:
        order = self.orders[s]
        for j in range(1, self.max_substitutes + 1):
            pieces = order.pieces(k + j * order.n_seq)
            if any((s, b) in self.store.bad for b, _, _ in pieces):
                continue
            try:
                self._fill(row, s, pieces, self.store.load_now)
            except ShardError:
                self._quarantine(s, pieces, None)  # type: ignore[arg-type]
                continue
            self.substituted += 1
            return
        raise ShardError(order.name, f"quarantine: no clean stand-in for sequence {k} within "
                         f"{self.max_substitutes} epochs (too many corrupt blocks?)")
