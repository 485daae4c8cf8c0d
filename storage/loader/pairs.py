"""`PairLoader`: preference pairs (chosen, rejected) for DPO-style objectives; `iter_pairs`: every pair of a
split in dataset order.

A preference source (manifest kind "preference", built by datapipe from `format: preference`) stores each
pair as two consecutive documents `ID#chosen`, `ID#rejected` in one block, each with its loss mask (the
completion's tokens). Pairs are numbered 0..n_pairs-1 in manifest source, shard, block and document order
(their *ordinal*, the key of per-pair artifacts such as precomputed reference log-probs).

The global order of pairs is a pure function of (manifest, seed, epoch): epoch e is a permutation of all
pairs of all preference sources seeded by (seed, e); global batch i holds pairs [i·G, (i+1)·G) of the
epochs laid end to end (G = global_batch_size, counted in pairs); DP rank r of W takes pairs
[r·G/W, (r+1)·G/W) of it. State is the number of pairs consumed, so a resume may change the DP size.

A batch is int64 [2·P, 5, seq_len] (P = G/W pairs), rows interleaved chosen, rejected, chosen, ...
(any micro-batch of an even number of rows holds whole pairs). Fields: input tokens (padding: the EOS id),
labels (the next token; 0 on the last token and on padding), loss mask (the shard mask of the label
token, as ConversationLoader builds it), segment ids (0 for the sequence, -1 for padding), and the
pair's ordinal (on every position of both rows). Each side sits alone in its row, unpacked; one longer
than seq_len is an error at start (build with `chat.max_tokens` <= seq_len).
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import torch

from storage import fs
from storage.dataset import Dataset, iter_documents
from storage.loader.background import BackgroundBatches, BlockCache, EpochShuffle
from storage.loader.config import LoaderConfig
from storage.loader.loader import dataset_fingerprint
from storage.manifest import read_manifest
from storage.shards import TAR_BLOCK, ShardError

FIELDS = 5  # tokens, labels, loss mask, segment ids, pair ordinal
_SALT = 0xD90  # keeps these permutations apart from the other loaders' for the same seed
SIDES = ("chosen", "rejected")


def _pair_id(chosen: str, rejected: str, where: str) -> str:
    """The pair id of two consecutive documents, checking that they are one pair's two sides."""
    if chosen.endswith("#chosen") and rejected.endswith("#rejected") and chosen[:-7] == rejected[:-9]:
        return chosen[:-7]
    raise ShardError(where, f"documents {chosen!r}, {rejected!r} are not the #chosen and #rejected sides of one "
                     "preference pair")


class PairTable:
    """Every pair of the preference sources' training shards: its block, both sides' spans there, its id.
    Read from the blocks' JSON members only."""

    def __init__(self, ds: Dataset, threads: int):
        self.blocks: list[tuple[object, int, str]] = []  # (ShardReader, k, source)
        for name, readers in ds.readers.items():
            if ds.manifest.sources[name].kind == "preference":
                for r in readers:
                    self.blocks.extend((r, k, name) for k in range(len(r.index)))
        if not self.blocks:
            kinds = {n: s.kind for n, s in ds.manifest.sources.items()}
            raise ValueError(f"dataset {ds.url}: no preference pairs (source kinds: {kinds}); build one with "
                             "`format: preference` sources")
        with ThreadPoolExecutor(max(1, threads)) as ex:
            metas = list(ex.map(self._meta, self.blocks))
        block, start, length, self.ids = [], [], [], []
        for b, (ids, offs) in enumerate(metas):
            if len(ids) % 2:
                raise ShardError(self.blocks[b][0].url, f"a preference block holds {len(ids)} documents (pairs "
                                 "come in twos)", self.blocks[b][0].index[self.blocks[b][1]].key)
            for j in range(0, len(ids), 2):
                self.ids.append(_pair_id(ids[j], ids[j + 1], self.blocks[b][0].url))
                block.append(b)
                start.append((offs[j], offs[j + 1]))
                length.append((offs[j + 1] - offs[j], offs[j + 2] - offs[j + 1]))
        self.block = np.asarray(block, dtype=np.int64)
        self.start = np.asarray(start, dtype=np.int64).reshape(-1, 2)
        self.length = np.asarray(length, dtype=np.int64).reshape(-1, 2)
        self.n = len(self.ids)

    @staticmethod
    def _meta(blk) -> tuple[list[str], list[int]]:
        reader, k, _ = blk
        e = reader.index[k]
        meta = fs.read_range(reader.url, e.meta_offset + TAR_BLOCK, e.meta_size)
        try:
            d = orjson.loads(meta)
            return [str(x) for x in d["doc_ids"]], [int(x) for x in d["offsets"]]
        except (ValueError, KeyError, TypeError) as err:
            raise ShardError(reader.url, f"bad block metadata: {err}", f"{e.key}.json") from None


class PairLoader(BackgroundBatches):
    """This DP rank's pairs of each global batch (see the module docstring).

    Same interface as ConversationLoader: iteration, state_dict / load_state_dict, metrics, close, and a
    context manager. `global_batch_size` counts pairs."""
    KIND, WHAT, THREAD = "pairs", "preference-pair", "pair-loader"

    def __init__(self, cfg: LoaderConfig, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        cfg.validate()
        if global_batch_size < 1 or global_batch_size % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad batch layout: global_batch_size={global_batch_size} pairs, dp_rank={dp_rank}, "
                             f"dp_size={dp_size}")
        self.cfg, self.G, self.rank, self.world = cfg, global_batch_size, dp_rank, dp_size
        self.P = global_batch_size // dp_size  # pairs of this rank per batch
        self.S = cfg.seq_len
        self.ds = Dataset.open(cfg.dataset)
        self.ds.manifest.validate()
        self.pad_id = int(self.ds.manifest.tokenizer.eos_id)
        self.pairs = PairTable(self.ds, cfg.threads())
        too_long = np.flatnonzero(self.pairs.length.max(axis=1) > self.S)
        if len(too_long):
            j = int(too_long[0])
            c, r = (int(x) for x in self.pairs.length[j])
            raise ValueError(f"preference pair {self.pairs.ids[j]!r}: chosen has {c:,} tokens, rejected {r:,}; "
                             f"seq_len is {self.S:,} ({len(too_long) - 1} more pairs too long); rebuild with "
                             f"chat.max_tokens <= seq_len or raise seq_len")
        self.fingerprint = {"dataset": dataset_fingerprint(self.ds.manifest), "seed": cfg.seed, "order": "pairs"}
        self._order = EpochShuffle(self.pairs.n, cfg.seed, _SALT)
        self._cache = BlockCache(cfg.max_bytes_in_flight)
        self._start_state(global_batch_size, self.P, dp_rank)

    # ---- the order ----
    @property
    def epoch_pairs(self) -> int:
        """Pairs per epoch (all pairs of all preference sources)."""
        return self.pairs.n

    def rows_in_epochs(self, epochs: float) -> int:
        """Pairs (this loader's rows: global_batch_size counts pairs) in the first `epochs` epochs (a fraction
        counts that share of an epoch's pairs)."""
        return self._order.in_epochs(epochs)

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s pair ordinals in order (the last two stay cached)."""
        return self._order.permutation(epoch)

    def ordinals(self, g0: int, n: int) -> np.ndarray:
        """Ordinals of global pairs [g0, g0 + n) (epochs laid end to end)."""
        return self._order.ordinals(g0, n)

    # ---- building batches ----
    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        def load():
            reader, k, _ = self.pairs.blocks[b]
            blk = reader.read_block(k)
            self._m["blocks_read"] += 1
            mask = None if blk.mask is None else np.asarray(blk.mask)
            return (np.asarray(blk.tokens), mask), blk.tokens.nbytes + (mask.nbytes if mask is not None else 0)
        return self._cache.get(b, load)

    def build(self, g0: int, n: int) -> torch.Tensor:
        """Global pairs [g0, g0 + n) as int64 [2n, 5, seq_len], rows chosen, rejected, chosen, ..."""
        S, t = self.S, self.pairs
        out = np.zeros((2 * n, FIELDS, S), dtype=np.int64)
        out[:, 0] = self.pad_id
        out[:, 3] = -1
        for i, o in enumerate(self.ordinals(g0, n).tolist()):
            tokens, mask = self._block(int(t.block[o]))
            for side in (0, 1):
                row, a, L = 2 * i + side, int(t.start[o, side]), int(t.length[o, side])
                out[row, 0, :L] = tokens[a:a + L]
                out[row, 1, :L - 1] = tokens[a + 1:a + L]
                out[row, 2, :L - 1] = 1 if mask is None else mask[a + 1:a + L]
                out[row, 3, :L] = 0
                out[row, 4] = o
                self._m["tokens"] += L
        return torch.from_numpy(out)

    # ---- metrics ----
    def metrics(self) -> dict:
        el = self.elapsed()
        return {"pairs": self._m["units"], "sequences": 2 * self._m["units"], "wait_s": self._m["wait_s"],
                "blocks_read": self._m["blocks_read"], "nonpad_tokens": self._m["tokens"],
                "tokens_per_s": self._m["tokens"] / el if el else 0.0, "epoch_pairs": self.pairs.n,
                "epoch": self.consumed // self.pairs.n}


def iter_pairs(dataset: str | Dataset, split: str = "train", verify: bool = True, source: str | None = None
               ) -> Iterator[tuple[int, str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Every pair of the preference sources of `split` ("train": the training shards, "validation": the
    held-out split) in dataset order, as (ordinal, pair_id, chosen_tokens, chosen_mask, rejected_tokens,
    rejected_mask): tokens int64, masks uint8 (1: the token carries loss), fresh arrays. For "train" the
    ordinal is the one PairLoader puts in its batches; the validation split numbers its own pairs from 0.
    `source`: that source's pairs only (ordinals as in the whole split)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    url = dataset.url if isinstance(dataset, Dataset) else dataset
    m = dataset.manifest if isinstance(dataset, Dataset) else read_manifest(url)
    sources = m.sources if split == "train" else m.validation
    ordinal = 0
    if source is not None and source not in sources:
        raise ValueError(f"{url}: no source {source!r} in the {split} split; sources: {', '.join(sources)}")
    for name, src in sources.items():
        if src.kind != "preference":
            continue
        docs = iter_documents(url, src.shards, verify=verify, with_mask=True)
        for c_id, c_tok, c_mask in docs:
            r_id, r_tok, r_mask = next(docs, (f"(none: {c_id!r} is the last document)", None, None))
            if source is not None and name != source:
                ordinal += 1
                continue
            yield (ordinal, _pair_id(c_id, r_id, url), c_tok.astype(np.int64), np.array(c_mask, dtype=np.uint8),
                   r_tok.astype(np.int64), np.array(r_mask, dtype=np.uint8))
            ordinal += 1
