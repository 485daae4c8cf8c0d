"""`ConversationLoader`: whole documents (conversations) packed into rows of `seq_len` by best-fit decreasing.

The pretraining `TokenLoader` cuts one token stream into windows; supervised fine-tuning wants every
conversation whole in one row, with its loss mask and its boundaries, so packed conversations can be
kept from attending to each other. The global order of rows is a pure function of (manifest, seq_len,
seed, shuffle_window), like the TokenLoader's: epoch e permutes all blocks of all sources (seed, e),
cuts the permutation into windows of about `shuffle_window` rows' worth of tokens, shuffles each window's
documents, packs them best-fit decreasing (the longest first, each into the fullest row it fits; a
document longer than `seq_len` is cut into pieces of `seq_len`, and counted) and shuffles the window's
rows. Global batch i holds rows [i·G, (i+1)·G) of the epochs laid end to end; DP rank r takes its slice.
State is the number of rows consumed, so a resume may change the DP size.

A batch is int64 [rows, 4, seq_len]: input tokens, labels (the next token of the same document),
loss mask (1 where the label is trained on: the shard's mask of the label token, all ones for sources
without masks; 0 on a document's last token and on padding) and segment ids (0, 1, ... per packed
piece, -1 for padding), from which the trainer builds positions and the attention mask.
A background thread builds batches ahead into a two-slot queue; decoded blocks are cached (LRU,
bounded by `max_bytes_in_flight`), and a window's rows only read that window's blocks.
"""
from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import torch

from storage import fs
from storage.dataset import Dataset
from storage.loader.background import BackgroundBatches
from storage.loader.config import LoaderConfig
from storage.loader.loader import dataset_fingerprint
from storage.loader.order import _rng
from storage.shards import TAR_BLOCK, ShardError

FIELDS = 4  # tokens, labels, loss mask, segment ids
_SALT = 0x5F7  # keeps these permutations apart from the TokenLoader's for the same seed


class EpochPlan:
    """One epoch's rows: row r holds pieces piece_cut[r]:piece_cut[r+1] of (doc, start, length)."""

    def __init__(self, docs: "DocTable", seq_len: int, seed: int, window_rows: int, epoch: int):
        S = seq_len
        perm = _rng(seed, _SALT, epoch).permutation(docs.n_blocks)
        budget = max(1, window_rows) * S
        pieces, row_cuts, split = [], [0], 0
        acc, start, bounds = 0, 0, []
        for i, b in enumerate(perm):
            acc += int(docs.block_tokens[b])
            if acc >= budget or i == len(perm) - 1:
                bounds.append(perm[start:i + 1])
                start, acc = i + 1, 0
        for w, blocks in enumerate(bounds):
            ids = np.concatenate([np.arange(docs.doc_cut[b], docs.doc_cut[b + 1]) for b in blocks]) \
                if len(blocks) else np.empty(0, np.int64)
            ids = ids[_rng(seed, _SALT, epoch, w + 1).permutation(len(ids))]
            lens = docs.length[ids]
            # documents longer than a row become pieces of seq_len (the last one shorter)
            n_pieces = np.maximum(1, -(-lens // S))
            split += int((n_pieces > 1).sum())
            p_doc = np.repeat(ids, n_pieces)
            first = np.cumsum(n_pieces) - n_pieces
            p_off = (np.arange(len(p_doc)) - np.repeat(first, n_pieces)) * S
            p_len = np.minimum(S, np.repeat(lens, n_pieces) - p_off)
            rows = _best_fit_decreasing(p_len, S)
            rows = [rows[k] for k in _rng(seed, _SALT, epoch, w + 1, 1).permutation(len(rows))]
            for r in rows:
                pieces.extend((int(p_doc[k]), int(p_off[k]), int(p_len[k])) for k in r)
                row_cuts.append(row_cuts[-1] + len(r))
        arr = np.array(pieces, dtype=np.int64).reshape(-1, 3)
        self.doc, self.start, self.length = arr[:, 0], arr[:, 1], arr[:, 2]
        self.piece_cut = np.array(row_cuts, dtype=np.int64)
        self.rows = len(row_cuts) - 1
        self.split_documents = split
        self.tokens = int(self.length.sum())
        self.efficiency = self.tokens / (self.rows * S) if self.rows else 0.0


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, in placement order): items by decreasing length (ties in the given
    order), each into the bin with the least free space that still holds it, else a new bin."""
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin), ascending
    for k in order.tolist():
        n = int(lengths[k])
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            space, b = free.pop(j)
            bins[b].append(k)
            if space - n > 0:
                bisect.insort(free, (space - n, b))
        else:
            bins.append([k])
            if capacity - n > 0:
                bisect.insort(free, (capacity - n, len(bins) - 1))
    return bins


class DocTable:
    """Every document of every source but preference pairs and RL prompts (the training shards, not the
    held-out split): its block and its token span there, read from the blocks' JSON members only."""

    def __init__(self, ds: Dataset, threads: int):
        self.blocks: list[tuple[object, int, str]] = []  # (ShardReader, k, source)
        for name, readers in ds.readers.items():
            if ds.manifest.sources[name].kind in ("preference", "prompts"):  # PairLoader's, PromptLoader's
                continue
            for r in readers:
                self.blocks.extend((r, k, name) for k in range(len(r.index)))
        with ThreadPoolExecutor(max(1, threads)) as ex:
            metas = list(ex.map(self._offsets, self.blocks))
        self.n_blocks = len(self.blocks)
        self.block_tokens = np.array([int(o[-1]) for o in metas], dtype=np.int64)
        counts = np.array([len(o) - 1 for o in metas], dtype=np.int64)
        self.doc_cut = np.concatenate([[0], np.cumsum(counts)])
        self.block = np.repeat(np.arange(self.n_blocks), counts)
        self.start = np.concatenate([np.asarray(o[:-1], np.int64) for o in metas]) if metas else np.empty(0, np.int64)
        self.length = np.concatenate([np.diff(np.asarray(o, np.int64)) for o in metas]) if metas \
            else np.empty(0, np.int64)
        if not len(self.length):
            raise ValueError(f"dataset {ds.url}: no documents to pack")

    @staticmethod
    def _offsets(blk) -> list[int]:
        reader, k, _ = blk
        e = reader.index[k]
        meta = fs.read_range(reader.url, e.meta_offset + TAR_BLOCK, e.meta_size)
        try:
            return [int(x) for x in orjson.loads(meta)["offsets"]]
        except (ValueError, KeyError, TypeError) as err:
            raise ShardError(reader.url, f"bad block metadata: {err}", f"{e.key}.json") from None


class ConversationLoader(BackgroundBatches):
    """This DP rank's rows of each global batch of packed documents (see the module docstring).

    Same interface as TokenLoader: iteration, state_dict / load_state_dict, metrics, close."""
    KIND, WHAT, THREAD = "packed", "packed-document", "sft-loader"


    def __init__(self, cfg: LoaderConfig, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        cfg.validate()
        if global_batch_size % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad batch layout: global_batch_size={global_batch_size}, dp_rank={dp_rank}, "
                             f"dp_size={dp_size}")
        self.cfg, self.G, self.rank, self.world = cfg, global_batch_size, dp_rank, dp_size
        self.rows = global_batch_size // dp_size
        self.S = cfg.seq_len
        self.ds = Dataset.open(cfg.dataset)
        self.ds.manifest.validate()
        self.pad_id = int(self.ds.manifest.tokenizer.eos_id)
        self.docs = DocTable(self.ds, cfg.threads())
        self.fingerprint = {"dataset": dataset_fingerprint(self.ds.manifest), "seq_len": cfg.seq_len,
                            "seed": cfg.seed, "shuffle_window": cfg.shuffle_window, "packing": "bfd"}
        self._plans: OrderedDict[int, EpochPlan] = OrderedDict()
        self._epoch_rows: list[int] = []  # rows of epochs 0, 1, ... as far as planned
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray | None]] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()
        self._start_state(global_batch_size, self.rows, dp_rank)

    # ---- the plan ----
    def plan(self, epoch: int) -> EpochPlan:
        """Epoch `epoch`'s rows (the last two planned stay cached)."""
        with self._lock:
            p = self._plans.get(epoch)
            if p is None:
                p = self._plans[epoch] = EpochPlan(self.docs, self.S, self.cfg.seed, self.cfg.shuffle_window, epoch)
                while len(self._plans) > 2:
                    self._plans.popitem(last=False)
            self._plans.move_to_end(epoch)
            return p

    def epoch_rows(self, epoch: int) -> int:
        while len(self._epoch_rows) <= epoch:
            self._epoch_rows.append(self.plan(len(self._epoch_rows)).rows)
        return self._epoch_rows[epoch]

    def rows_in_epochs(self, epochs: float) -> int:
        """Rows in the first `epochs` epochs (a fraction counts that share of the last one's rows)."""
        whole = int(epochs)
        total = sum(self.epoch_rows(e) for e in range(whole))
        if epochs > whole:
            total += int((epochs - whole) * self.epoch_rows(whole))
        return total

    def _locate(self, g: int) -> tuple[int, int]:
        """(epoch, row within it) of global row g."""
        e = 0
        while g >= self.epoch_rows(e):
            g -= self.epoch_rows(e)
            e += 1
        return e, g

    # ---- building batches ----
    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        hit = self._cache.get(b)
        if hit is not None:
            self._cache.move_to_end(b)
            return hit
        reader, k, _ = self.docs.blocks[b]
        blk = reader.read_block(k)
        mask = getattr(blk, "mask", None)
        hit = (np.asarray(blk.tokens), None if mask is None else np.asarray(mask))
        self._m["blocks_read"] += 1
        self._cache[b] = hit
        self._cache_bytes += hit[0].nbytes + (hit[1].nbytes if hit[1] is not None else 0)
        while self._cache_bytes > self.cfg.max_bytes_in_flight and len(self._cache) > 1:
            _, (t, m) = self._cache.popitem(last=False)
            self._cache_bytes -= t.nbytes + (m.nbytes if m is not None else 0)
        return hit

    def build(self, g0: int, n: int) -> torch.Tensor:
        """Global rows [g0, g0 + n) as int64 [n, 4, seq_len]."""
        S, d = self.S, self.docs
        out = np.zeros((n, FIELDS, S), dtype=np.int64)
        out[:, 0] = self.pad_id
        for i in range(n):
            e, r = self._locate(g0 + i)
            p = self.plan(e)
            pos = 0
            for seg, j in enumerate(range(p.piece_cut[r], p.piece_cut[r + 1])):
                doc, off, L = int(p.doc[j]), int(p.start[j]), int(p.length[j])
                tokens, mask = self._block(int(d.block[doc]))
                a = int(d.start[doc]) + off
                end = int(d.start[doc]) + int(d.length[doc])  # the document's end in its block
                z = min(a + L + 1, end)  # one token past the piece when the document goes on
                out[i, 0, pos:pos + L] = tokens[a:a + L]
                out[i, 1, pos:pos + z - a - 1] = tokens[a + 1:z]
                out[i, 2, pos:pos + z - a - 1] = 1 if mask is None else mask[a + 1:z]
                out[i, 3, pos:pos + L] = seg
                pos += L
            out[i, 3, pos:] = -1  # padding
            self._m["tokens"] += pos
        return torch.from_numpy(out)

    # ---- metrics ----
    def metrics(self) -> dict:
        el = self.elapsed()
        p = self.plan(self._locate(self.consumed)[0])
        return {"sequences": self._m["units"], "wait_s": self._m["wait_s"], "blocks_read": self._m["blocks_read"],
                "nonpad_tokens": self._m["tokens"], "tokens_per_s": self._m["tokens"] / el if el else 0.0,
                "packing_efficiency": p.efficiency, "split_documents": p.split_documents, "epoch_rows": p.rows}

