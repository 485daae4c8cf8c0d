"""`PromptLoader`: RL prompts with their reference answers, in a DP-independent order, for online RL
(GRPO, RLOO, PPO); `iter_prompts`: every prompt of a split in dataset order (held-out reward evaluation).

A prompts source (manifest kind "prompts", built by datapipe from `format: prompts`) stores each prompt as
one document: its tokens are the chat-template rendering up to and including the generation prompt (no
EOS, no loss mask), and its entry in the block JSON's `doc_meta` holds the record's `answer` and, as
`extra`, its other fields. Prompts are numbered 0..n-1 in manifest source, shard, block and document order
over all prompts sources (their *ordinal*, the key of per-prompt artifacts).

The global order is a pure function of (manifest, seed, epoch): epoch e is a permutation of all prompts
seeded by (seed, e); global batch i holds prompts [i·G, (i+1)·G) of the epochs laid end to end (G =
global_batch_size, counted in prompts); DP rank r of W takes prompts [i·G + r·G/W, i·G + (r+1)·G/W). State
is the number of prompts consumed, so a resume may change the DP size. `next(loader)` returns this rank's
G/W prompts as `Prompt` records, unpadded (the RL step generates from them and pads as its engine needs).
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from storage import fs
from storage.dataset import Dataset
from storage.loader.background import BackgroundBatches, BlockCache, EpochShuffle
from storage.loader.config import LoaderConfig
from storage.loader.loader import dataset_fingerprint
from storage.shards import TAR_BLOCK, ShardError

KIND = "prompts"
_SALT = 0x9A7  # keeps these permutations apart from the other loaders' for the same seed


@dataclass
class Prompt:
    """One RL prompt: its token ids (rendered with the generation prompt), the reference answer (None when
    the record had none), its document id (`SOURCE/ID`), its ordinal in its split (stable for a dataset), and
    the record's other fields (`extra`, e.g. for a user's reward function)."""
    ids: list[int]
    answer: str | None
    doc_id: str
    ordinal: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        return self.doc_id.split("/", 1)[0]


class PromptTable:
    """Every prompt of the prompts sources of one split: its block and token span there, and its id; read
    from the blocks' JSON members only."""

    def __init__(self, ds: Dataset, threads: int, split: str = "train"):
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        sources = ds.manifest.sources if split == "train" else ds.manifest.validation
        readers = ds.readers if split == "train" else ds.validation_readers
        self.blocks: list[tuple[object, int, str]] = []  # (ShardReader, k, source)
        for name, src in sources.items():
            if src.kind == KIND:
                for r in readers[name]:
                    self.blocks.extend((r, k, name) for k in range(len(r.index)))
        with ThreadPoolExecutor(max(1, threads)) as ex:
            metas = list(ex.map(self._meta, self.blocks))
        self.ids = [doc_id for ids, _ in metas for doc_id in ids]
        counts = np.array([len(ids) for ids, _ in metas], dtype=np.int64)
        self.block = np.repeat(np.arange(len(self.blocks), dtype=np.int64), counts)
        offs = [np.asarray(o, dtype=np.int64) for _, o in metas]
        self.start = np.concatenate([o[:-1] for o in offs]) if offs else np.empty(0, np.int64)
        self.length = np.concatenate([np.diff(o) for o in offs]) if offs else np.empty(0, np.int64)
        self.first = np.concatenate([[0], np.cumsum(counts)])  # ordinal of each block's first prompt
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


def _read(table: PromptTable, b: int) -> tuple[np.ndarray, list[dict]]:
    """Block b's tokens and per-prompt metadata (checksums verified)."""
    reader, k, _ = table.blocks[b]
    blk = reader.read_block(k)
    if blk.doc_meta is None:
        raise ShardError(reader.url, "a prompts block has no doc_meta (built by another datapipe?)", f"{blk.key}.json")
    return np.asarray(blk.tokens), blk.doc_meta


def _prompt(tokens: np.ndarray, meta: dict, table: PromptTable, o: int) -> Prompt:
    """Prompt `o` of `table`, from its block's tokens and its `doc_meta` entry."""
    a = int(table.start[o])
    return Prompt(tokens[a:a + int(table.length[o])].tolist(), meta.get("answer"), table.ids[o], o,
                  meta.get("extra", {}))


class PromptLoader(BackgroundBatches):
    """This DP rank's prompts of each global batch (see the module docstring).

    Same contract as PairLoader and ConversationLoader: iteration, state_dict / load_state_dict,
    rows_in_epochs, metrics, close, and a context manager. `global_batch_size` counts prompts; keys used:
    `dataset`, `seed`, `max_bytes_in_flight` (decoded blocks kept), `prefetch_threads` (start-up read of
    every block's JSON)."""
    KIND, WHAT, THREAD = "prompts", "prompt", "prompt-loader"

    def __init__(self, cfg: LoaderConfig, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        cfg.validate()
        if global_batch_size < 1 or dp_size < 1 or global_batch_size % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad batch layout: global_batch_size={global_batch_size} prompts, dp_rank={dp_rank}, "
                             f"dp_size={dp_size}")
        self.cfg, self.world = cfg, dp_size
        self.P = global_batch_size // dp_size  # prompts of this rank per batch
        self.ds = Dataset.open(cfg.dataset)
        self.ds.manifest.validate()
        self.prompts = PromptTable(self.ds, cfg.threads())
        if not self.prompts.n:
            kinds = {n: s.kind for n, s in self.ds.manifest.sources.items()}
            raise ValueError(f"dataset {self.ds.url}: no prompts (source kinds: {kinds}); build one with "
                             "`format: prompts` sources")
        self.fingerprint = {"dataset": dataset_fingerprint(self.ds.manifest), "seed": cfg.seed, "order": "prompts"}
        self._order = EpochShuffle(self.prompts.n, cfg.seed, _SALT)
        self._cache = BlockCache(cfg.max_bytes_in_flight)
        self._start_state(global_batch_size, self.P, dp_rank)

    # ---- the order ----
    @property
    def epoch_prompts(self) -> int:
        """Prompts per epoch (all prompts of all prompts sources' training shards)."""
        return self.prompts.n

    @property
    def max_prompt_tokens(self) -> int:
        """Tokens of the longest prompt (at most the build's `chat.max_tokens`)."""
        return int(self.prompts.length.max())

    def rows_in_epochs(self, epochs: float) -> int:
        """Prompts in the first `epochs` epochs (a fraction counts that share of an epoch's prompts)."""
        return self._order.in_epochs(epochs)

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s prompt ordinals in order."""
        return self._order.permutation(epoch)

    def ordinals(self, g0: int, n: int) -> np.ndarray:
        """Ordinals of global prompts [g0, g0 + n) (epochs laid end to end)."""
        return self._order.ordinals(g0, n)

    # ---- building batches ----
    def _block(self, b: int) -> tuple[np.ndarray, list[dict]]:
        def load():
            self._m["blocks_read"] += 1
            tokens, meta = _read(self.prompts, b)
            return (tokens, meta), tokens.nbytes
        return self._cache.get(b, load)

    def build(self, g0: int, n: int) -> list[Prompt]:
        """Global prompts [g0, g0 + n)."""
        t, out = self.prompts, []
        for o in self.ordinals(g0, n).tolist():
            b = int(t.block[o])
            tokens, meta = self._block(b)
            out.append(_prompt(tokens, meta[o - int(t.first[b])], t, o))
            self._m["tokens"] += int(t.length[o])
        return out

    # ---- metrics ----
    def metrics(self) -> dict:
        el = self.elapsed()
        return {"prompts": self._m["units"], "wait_s": self._m["wait_s"], "blocks_read": self._m["blocks_read"],
                "prompt_tokens": self._m["tokens"], "tokens_per_s": self._m["tokens"] / el if el else 0.0,
                "epoch_prompts": self.prompts.n, "epoch": self.consumed // self.prompts.n}


def iter_prompts(dataset: str | Dataset, split: str = "train", threads: int = 4) -> Iterator[Prompt]:
    """Every prompt of the prompts sources of `split` ("train": the training shards, "validation": the
    held-out split) in dataset order, block by block (checksums verified). For "train" the ordinals are
    PromptLoader's; the validation split numbers its prompts from 0."""
    ds = dataset if isinstance(dataset, Dataset) else Dataset.open(dataset)
    table = PromptTable(ds, threads, split)
    for b in range(len(table.blocks)):
        tokens, meta = _read(table, b)
        for j, o in enumerate(range(int(table.first[b]), int(table.first[b + 1]))):
            yield _prompt(tokens, meta[j], table, o)
