"""The loader benchmark's peers (tools/bench/bench_loader.py): stock webdataset in order, the same in
DataLoader workers, and a raw reader of whole shards through our index, each packed into batches of
sequences by `Packer` as a plain training loop would."""
from __future__ import annotations

import json
import os

import lz4.frame
import numpy as np
import torch
import webdataset as wds
from numpy.lib.stride_tricks import sliding_window_view

from storage.shards import TAR_BLOCK, parse_index


class Packer:
    """Cut seq_len + 1 windows every seq_len tokens from the concatenated token arrays and emit int64
    batches; each token is widened and copied once, from a sliding-window view straight into the batch
    (as our loader's packing), so the peers pay no more per token than ours for the same rows."""

    def __init__(self, seq_len: int, batch: int):
        self.L, self.B, self.tail = seq_len, batch, np.empty(0, np.uint16)
        self.out, self.filled = np.empty((batch, seq_len + 1), np.int64), 0

    def add(self, toks: np.ndarray):
        buf = np.concatenate([self.tail, toks]) if len(self.tail) else toks
        n, i = (len(buf) - 1) // self.L, 0
        rows = sliding_window_view(buf, self.L + 1)[::self.L] if n > 0 else None
        while i < n:
            k = min(n - i, self.B - self.filled)
            self.out[self.filled:self.filled + k] = rows[i:i + k]
            self.filled, i = self.filled + k, i + k
            if self.filled == self.B:
                yield torch.from_numpy(self.out)
                self.out, self.filled = np.empty((self.B, self.L + 1), np.int64), 0
        self.tail = buf[n * self.L:]


def webdataset_blocks(shards: list[str]):
    """Each block's tokens through stock webdataset: in order, its JSON parsed, LZ4-decoded."""
    for s in wds.WebDataset(shards, shardshuffle=False):
        json.loads(s["json"])
        yield np.frombuffer(lz4.frame.decompress(s["tokens.lz4"]), "<u2")


def webdataset_batches(shards: list[str], seq_len: int, batch: int):
    p = Packer(seq_len, batch)
    for toks in webdataset_blocks(shards):
        yield from p.add(toks)


def raw_batches(shards: list[str], seq_len: int, batch: int):
    """Each shard read whole into one reused buffer (a fresh 8 MiB read per shard would pay page faults
    that a careful reader avoids, and would make the flatness control uneven: 4 or 5 shards per window)."""
    p = Packer(seq_len, batch)
    buf = bytearray(max(os.path.getsize(u) for u in shards))
    for url in shards:
        with open(url, "rb", buffering=0) as f:
            data = memoryview(buf)[:f.readinto(buf)]
        with open(url + ".idx") as f:
            index = parse_index(f.read(), url)
        for e in index:
            payload = data[e.tokens_offset + TAR_BLOCK: e.tokens_offset + TAR_BLOCK + e.tokens_size]
            yield from p.add(np.frombuffer(lz4.frame.decompress(payload), "<u2"))


class _WdsBlocks(torch.utils.data.IterableDataset):
    """webdataset + LZ4 in each DataLoader worker (webdataset splits the shards by worker): whole blocks'
    uint16 tokens. `repeat`: the workers, started once, cycle over their shards (a long run)."""

    def __init__(self, shards: list[str], repeat: bool):
        super().__init__()
        self.shards, self.repeat = shards, repeat

    def __iter__(self):
        return cycled(lambda: webdataset_blocks(self.shards)) if self.repeat else webdataset_blocks(self.shards)


def webdataset_dataloader_batches(shards: list[str], seq_len: int, batch: int, workers: int, repeat: bool = False):
    """Blocks handed over as numpy arrays (collate_fn passes them through, so they are pickled through the
    worker's pipe: 1.2-1.5x less CPU here than the default conversion to tensors in fresh shared memory)."""
    p = Packer(seq_len, batch)
    it = iter(torch.utils.data.DataLoader(_WdsBlocks(shards, repeat), batch_size=None, num_workers=workers,
                                          collate_fn=lambda x: x))
    try:
        for toks in it:
            yield from p.add(toks)
    finally:
        del it  # shuts the workers down and reaps them now, so that cpu_s() counts them


def cycled(make):
    """Batches of pass after pass (a fresh iterator each): an in-order reader over a run longer than the data."""
    while True:
        yield from make()
