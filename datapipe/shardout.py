"""Shards written by the tokenize tasks themselves, and the held-out validation split.

Each tokenize task packs its documents straight into its source's shards `SOURCE/shard-TTTTT-NNNN.tar`
(TTTTT: the task's rank), so no stage gathers a whole source and shard names never depend on the number
of workers. A document is a validation candidate when the hash of (source, id) falls below
`validation.fraction` (a preference pair: the pair id); candidates, a small fraction, wait in the work
dir (`valcands/RANK.*`). One task per source then holds out the candidates with the smallest hashes up
to the caps (`validation/SOURCE/shard-NNNNNN.tar`) and packs those beyond a cap into training shards
numbered after every tokenize task (`SOURCE/shard-<tasks>-NNNN.tar`), and removes shard files an earlier
build of another config left in `SOURCE/`. Per-task results go to `tasks/RANK.json`; the manifest stage
lists a source's shards in task order.
"""
from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash
from datatrove.pipeline.base import PipelineStep

from datapipe.config import ValidationConfig
from datapipe.workfiles import atomic_json, atomic_npy, read_json
from storage import config as cfgmod
from storage.dataset import VALIDATION_PREFIX, SourceWriter
from storage.manifest import SourceInfo
from storage.shards import dtype_for_vocab

VALIDATION_SEED = 0x5EED_0001  # fixed: the held-out set must not move between builds


def holdout_score(source: str, doc_id: str) -> float:
    """xxh64 (seed `VALIDATION_SEED`) of `SOURCE\\0DOC_ID`, its top 53 bits mapped to [0, 1)."""
    h = xxhash.xxh64_intdigest(f"{source}\0{doc_id}".encode(), seed=VALIDATION_SEED)
    return (h >> 11) * 2.0**-53


def select_validation(source: str, docs: Iterable[tuple[str, int]], cfg: ValidationConfig) -> set[int]:
    """Positions (in `docs` order) of the held-out documents among `docs` = (doc_id, tokens) pairs:
    candidates by `holdout_score < fraction`, smallest scores first, until a cap would be exceeded."""
    if not cfg.enabled:
        return set()
    cands = []
    for pos, (doc_id, n) in enumerate(docs):
        score = holdout_score(source, doc_id)
        if score < cfg.fraction:
            cands.append((score, pos, n))
    cands.sort()  # ties (equal ids) fall back to position, so the choice is still deterministic
    held: set[int] = set()
    tokens = 0
    for _, pos, n in cands:
        if cfg.max_documents is not None and len(held) + 1 > cfg.max_documents:
            break
        if cfg.max_tokens is not None and tokens + n > cfg.max_tokens:
            break
        held.add(pos)
        tokens += n
    return held


@dataclass
class ShardOut:
    """Where and how the tokenize tasks write shards."""
    dataset: str
    work: str
    tokenizer_path: str  # the dataset's tokenizer.json, written by the tokenizer stage
    block_tokens: int
    shard_blocks: int
    validation: ValidationConfig
    kinds: dict[str, str | None]  # source → SourceWriter kind ("preference", "prompts" or None: from the masks)


def dtype_of(tokenizer_path: str) -> str:
    from tokenizers import Tokenizer

    return dtype_for_vocab(Tokenizer.from_file(tokenizer_path).get_vocab_size(with_added_tokens=True)).name


def task_info_path(work: str, rank: int) -> str:
    return os.path.join(work, "tasks", f"{rank:05d}.json")


def _remove_task_shards(dataset: str, prefix: str, source: str, task: int) -> None:
    for p in glob.glob(os.path.join(dataset, prefix, source, f"shard-{task:05d}-*")):
        os.remove(p)  # an interrupted attempt's shards: this attempt rewrites them


class TaskShards:
    """One tokenize task's output: groups of documents (a group shares a block) to its training shards,
    or, when their key is a validation candidate, to `valcands/RANK.*`."""

    def __init__(self, out: ShardOut, source: str, rank: int, dtype: str):
        self.out, self.source, self.rank, self.dtype = out, source, rank, dtype
        _remove_task_shards(out.dataset, "", source, rank)
        self.train = SourceWriter(out.dataset, source, dtype, block_tokens=out.block_tokens,
                                  shard_blocks=out.shard_blocks, kind=out.kinds.get(source), task=rank)
        self.groups: list[list] = []  # candidates: [key, [[doc_id, tokens], ...]] (+ [meta, ...] with metadata)
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []

    def add_group(self, key: str, group: list[tuple[str, np.ndarray, np.ndarray | None]],
                  meta: list[dict] | None = None) -> None:
        """`meta`: one block-metadata object per document of the group (prompts), or None."""
        val = self.out.validation
        if val.enabled and holdout_score(self.source, key) < val.fraction:
            cand = [key, [[doc_id, len(t)] for doc_id, t, _ in group]]
            self.groups.append(cand if meta is None else [*cand, meta])
            self.tokens += [np.asarray(t) for _, t, _ in group]
            self.masks += [np.asarray(m, np.uint8) for _, _, m in group if m is not None]
        else:
            self.train.add_group(group, meta)

    def add_documents(self, doc_ids: list[str], tokens: np.ndarray, lengths: list[int],
                      meta: list[dict] | None = None) -> None:
        """Documents without masks, each a group of its own, concatenated in `tokens` (a batch at once:
        what add_group does per document, without its per-call work); `meta`: one object per document or None."""
        val, off = self.out.validation, 0
        train: list[tuple[str, int, int]] = []
        train_meta: list[dict] = []
        for k, (doc_id, n) in enumerate(zip(doc_ids, lengths)):
            if val.enabled and holdout_score(self.source, doc_id) < val.fraction:
                self.groups.append([doc_id, [[doc_id, n]]] + ([[meta[k]]] if meta is not None else []))
                self.tokens.append(tokens[off:off + n])
            else:
                train.append((doc_id, off, n))
                if meta is not None:
                    train_meta.append(meta[k])
            off += n
        self.train.add_documents(tokens, train, train_meta if meta is not None else None)

    def close(self, counts: dict[str, int]) -> None:
        info = self.train.close()
        base = os.path.join(self.out.work, "valcands", f"{self.rank:05d}")
        if self.groups:
            atomic_npy(base + ".tokens.npy", np.concatenate(self.tokens).astype(self.dtype))
            if self.masks:
                atomic_npy(base + ".mask.npy", np.concatenate(self.masks))
        atomic_json(base + ".json", {"groups": self.groups, "masked": bool(self.masks)})
        atomic_json(task_info_path(self.out.work, self.rank),
                    {"source": self.source, "info": cfgmod.to_plain(info), "counts": counts,
                     "candidates": len(self.groups)})

    def abort(self) -> None:
        self.train.abort()


def _candidates(work: str, rank: int):
    """(key, [(doc_id, tokens, mask or None), ...], [meta, ...] or None) of one task's validation candidates."""
    base = os.path.join(work, "valcands", f"{rank:05d}")
    meta = read_json(base + ".json")
    if not meta["groups"]:
        return
    tokens = np.load(base + ".tokens.npy", allow_pickle=False)
    masks = np.load(base + ".mask.npy", allow_pickle=False) if meta["masked"] else None
    off = 0
    for key, docs, *doc_meta in meta["groups"]:
        group = []
        for doc_id, n in docs:
            group.append((doc_id, tokens[off:off + n], None if masks is None else masks[off:off + n]))
            off += n
        yield key, group, (doc_meta[0] if doc_meta else None)


class WriteValidation(PipelineStep):
    """Task `rank` makes source number `rank`'s held-out split from its tasks' candidates (see module doc);
    writes `sources/SOURCE.validation.json` and `sources/SOURCE.overflow.json` to the work dir."""

    name = "🧪 validation split"

    def __init__(self, out: ShardOut, sources: list[str], ranks_of: dict[str, list[int]], n_tasks: int):
        super().__init__()
        self.out, self.sources, self.ranks_of, self.n_tasks = out, sources, ranks_of, n_tasks

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        name, out = self.sources[rank], self.out
        val_dir = os.path.join(out.dataset, VALIDATION_PREFIX, name)
        if os.path.isdir(val_dir):  # a rerun rewrites the split from scratch
            shutil.rmtree(val_dir)
        _remove_task_shards(out.dataset, "", name, self.n_tasks)
        ranks = self.ranks_of[name]
        keys = [(key, sum(len(t) for _, t, _ in g)) for r in ranks for key, g, _ in _candidates(out.work, r)]
        held = select_validation(name, keys, out.validation)
        kw = dict(block_tokens=out.block_tokens, shard_blocks=out.shard_blocks, kind=out.kinds.get(name))
        dtype = dtype_of(out.tokenizer_path)
        val = SourceWriter(out.dataset, name, dtype, prefix=VALIDATION_PREFIX, **kw)
        overflow = SourceWriter(out.dataset, name, dtype, task=self.n_tasks, **kw)
        try:
            pos = 0
            for r in ranks:
                for _, group, meta in _candidates(out.work, r):
                    (val if pos in held else overflow).add_group(group, meta)
                    pos += 1
        except BaseException:
            val.abort()
            overflow.abort()
            raise
        infos = {}
        for suffix, writer in (("validation", val), ("overflow", overflow)):
            infos[suffix] = writer.close()
            atomic_json(os.path.join(out.work, "sources", f"{name}.{suffix}.json"), cfgmod.to_plain(infos[suffix]))
        keep = {sh.path for sh in infos["overflow"].shards}
        keep |= {sh["path"] for r in ranks for sh in read_json(task_info_path(out.work, r))["info"]["shards"]}
        for p in glob.glob(os.path.join(out.dataset, name, "shard-*")):  # an earlier build's (other pieces)
            if os.path.relpath(p, out.dataset).removesuffix(".idx") not in keep:
                os.remove(p)


def source_infos(work: str, name: str, ranks: list[int], kind: str) -> tuple[SourceInfo, SourceInfo]:
    """A source's training SourceInfo (its tasks' shards in task order, then the overflow) and its
    held-out one."""
    parts = [read_json(task_info_path(work, r))["info"] for r in ranks]
    parts.append(read_json(os.path.join(work, "sources", f"{name}.overflow.json")))
    train = SourceInfo(kind=kind)
    for p in parts:
        info = cfgmod.from_dict(SourceInfo, p)
        train.shards += info.shards
        train.documents += info.documents
        train.tokens += info.tokens
    val = cfgmod.from_dict(SourceInfo, read_json(os.path.join(work, "sources", f"{name}.validation.json")))
    return train, val
