"""The build's own datatrove steps: per-source filter chains, work-file reader, and the one-task stages
(exact-dup resolution, near-dup cluster resolution, tokenizer training, shard writing).

One-task stages are plain (non-generator) `run` methods, so they also run under the Slurm and Ray
executors as ordinary tasks chained with `depends`.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from datapipe.chat import load_template, template_special_tokens
from datapipe.config import BuildConfig, ValidationConfig
from datapipe.dedup.exact import find_exact_duplicates
from datapipe.dedup.minhash import resolve_clusters
from datapipe.filters import build_filter, filter_label, word_tokenizer
from datapipe.sources import InputFile
from datapipe.tokenize import check_special_tokens, load_tokenizer, tokenizer_info, train_bpe, write_source
from datapipe.workfiles import atomic_json, atomic_npy, load_npy
from storage import config as cfgmod
from storage.dataset import VALIDATION_PREFIX
from storage.fs import atomic_write_bytes


def stats_of(step: PipelineStep) -> dict[str, int]:
    return {k: int(v.total) for k, v in step.stats.stats.items()}


class PerSourceFilters(PipelineStep):
    """Applies the filter chain configured for the source of this task's file; records drops per filter."""

    name = "🔻 quality filters"
    type = "🔻 - FILTER"

    def __init__(self, cfg: BuildConfig, files: list[InputFile], rejects: str, counts_dir: str):
        super().__init__()
        self.cfg, self.files, self.rejects, self.counts_dir = cfg, files, rejects, counts_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        src = {s.name: s for s in self.cfg.sources}[self.files[rank].source]
        tok = word_tokenizer(self.cfg.word_tokenizer)
        specs = self.cfg.filters_for(src)
        chain = [build_filter(spec, tok, self.rejects, i) for i, spec in enumerate(specs)]
        for flt in chain:
            data = flt.run(data, rank, world_size)
        yield from data
        counts = {}
        for i, (spec, flt) in enumerate(zip(specs, chain)):
            st = stats_of(flt)
            label = filter_label(spec, i)
            counts[label] = st.get("dropped", 0)
            for k, v in st.items():
                if k.startswith("dropped_"):
                    counts[f"{label}:{k[len('dropped_'):]}"] = v
        atomic_json(os.path.join(self.counts_dir, f"{rank:05d}.json"), counts)


class CountsDump(PipelineStep):
    """Pass-through that, at the end of the task, saves the stats of the given steps (by label)."""

    name = "🧮 counts"

    def __init__(self, steps: dict[str, PipelineStep], counts_dir: str):
        super().__init__()
        self.steps, self.counts_dir = steps, counts_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        n = 0
        for doc in data:
            n += 1
            yield doc
        out = {label: stats_of(step) for label, step in self.steps.items()}
        out["out"] = n
        atomic_json(os.path.join(self.counts_dir, f"{rank:05d}.json"), out)


class WorkReader(PipelineStep):
    """Reads `folder/{rank:05d}.jsonl` written by an earlier stage (missing file: no documents)."""

    name = "📂 work reader"
    type = "📖 - READER"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        path = os.path.join(self.folder, f"{rank:05d}.jsonl")
        if not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                yield Document(text=d["text"], id=d["id"], metadata=d.get("metadata") or {})


class ExactResolve(PipelineStep):
    name = "#️⃣ exact dedup (global)"

    def __init__(self, enabled: bool, hash_dir: str, out_dir: str, n_ranks: int, report: str):
        super().__init__()
        self.enabled, self.hash_dir, self.out_dir = enabled, hash_dir, out_dir
        self.n_ranks, self.report = n_ranks, report

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        if self.enabled:
            find_exact_duplicates(self.hash_dir, self.out_dir, self.n_ranks, self.report)
        else:
            for r in range(self.n_ranks):
                atomic_npy(os.path.join(self.out_dir, f"{r:05d}.remove.npy"), np.zeros(0, np.uint32))


class ClusterResolve(PipelineStep):
    name = "🎯 near-dup clusters (priority keep)"

    def __init__(self, cluster_dir: str, remove_dir: str, n_ranks: int, ids_dir: str, report: str):
        super().__init__()
        self.args = (cluster_dir, remove_dir, n_ranks, ids_dir, report)

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        resolve_clusters(*self.args)


class PrepareTokenizer(PipelineStep):
    """Copies the configured tokenizer.json into the dataset, or trains a byte-level BPE on kept text
    (with the chat template's control tokens as special tokens when there are chat sources)."""

    name = "🔤 tokenizer"

    def __init__(self, cfg: BuildConfig, out_path: str, deduped_dir: str, remove_dir: str | None, n_ranks: int):
        super().__init__()
        self.cfg, self.out_path, self.deduped_dir = cfg, out_path, deduped_dir
        self.remove_dir, self.n_ranks = remove_dir, n_ranks

    def _texts(self):
        left = self.cfg.tokenizer.train_max_docs
        for r in range(self.n_ranks):
            rm: set[int] = set()
            if self.remove_dir:
                p = os.path.join(self.remove_dir, f"{r:06d}.remove")
                rm = set(np.fromfile(p, dtype="<u4").tolist()) if os.path.exists(p) else set()
            for i, doc in enumerate(WorkReader(self.deduped_dir).run(rank=r)):
                if i in rm:
                    continue
                if left <= 0:
                    return
                left -= 1
                yield doc.text

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        tc = self.cfg.tokenizer
        if tc.path:
            if os.path.isfile(tc.path):
                with open(tc.path, "rb") as f:
                    atomic_write_bytes(self.out_path, f.read())
            else:
                atomic_write_bytes(self.out_path, load_tokenizer(tc.path).to_str().encode())
        else:
            train_bpe(self._texts(), tc.vocab_size, tc.eos_token, self.out_path, self._special_tokens())
        if self.cfg.chat_template:
            check_special_tokens(load_tokenizer(self.out_path), self._special_tokens(), f"tokenizer {tc.path}")

    def _special_tokens(self) -> list[str]:
        """tokenizer.special_tokens, then the chat template's control tokens (single tokens in a trained BPE)."""
        chat = template_special_tokens(load_template(self.cfg.chat_template)) if self.cfg.chat_template else []
        return list(dict.fromkeys([*self.cfg.tokenizer.special_tokens, *chat]))


class WriteShards(PipelineStep):
    """Task `rank` packs source number `rank` into shards and its held-out split into validation shards;
    both SourceInfos go to the work dir (`SOURCE.json`, `SOURCE.validation.json`)."""

    name = "📦 shards"

    def __init__(self, dataset: str, sources: list[str], ranks_of: dict[str, list[int]], token_dir: str,
                 tokenizer_path: str, eos_token: str, block_tokens: int, shard_blocks: int, info_dir: str,
                 validation: ValidationConfig | None = None):
        super().__init__()
        self.dataset, self.sources, self.ranks_of, self.token_dir = dataset, sources, ranks_of, token_dir
        self.tokenizer_path, self.eos_token = tokenizer_path, eos_token
        self.block_tokens, self.shard_blocks, self.info_dir = block_tokens, shard_blocks, info_dir
        self.validation = validation

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        name = self.sources[rank]
        for folder in (os.path.join(self.dataset, name), os.path.join(self.dataset, VALIDATION_PREFIX, name)):
            if os.path.isdir(folder):  # a rerun rewrites the source from scratch
                shutil.rmtree(folder)
        dtype = tokenizer_info(self.tokenizer_path, self.eos_token).dtype
        info, val = write_source(self.dataset, name, self.ranks_of[name], self.token_dir, dtype,
                                 self.block_tokens, self.shard_blocks, self.validation)
        atomic_json(os.path.join(self.info_dir, f"{name}.validation.json"), cfgmod.to_plain(val))
        atomic_json(os.path.join(self.info_dir, f"{name}.json"), cfgmod.to_plain(info))


def load_remove_count(path: str, fmt: str) -> int:
    if not os.path.exists(path):
        return 0
    if fmt == "npy":
        return len(load_npy(path, np.uint32))
    return os.path.getsize(path) // 4
