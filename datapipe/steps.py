"""The build's own datatrove steps: per-source filter chains, per-task counts, and the one-task stages
(near-dup cluster resolution, tokenizer training).

One-task stages are plain (non-generator) `run` methods, so they also run under the Slurm and Ray
executors as ordinary tasks chained with `depends`.
"""
from __future__ import annotations

import os

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datapipe.rejects import RejectsWriter

from storage.chat import load_template, template_special_tokens
from datapipe.config import BuildConfig
from datapipe.filters import chain_filter, filter_label
from datapipe.langid import IdentifyLanguage
from datapipe.sources import InputFile
from datapipe.tokenize import check_special_tokens, load_tokenizer, train_bpe
from datapipe.workfiles import atomic_json
from storage import atomic


def stats_of(step: PipelineStep) -> dict[str, int]:
    return {k: int(v.total) for k, v in step.stats.stats.items()}


class PerSourceFilters(PipelineStep):
    """Identifies each document's language (unless `langid.enabled` is false and the source declares
    none), then applies the filter
    chain configured for the source of this task's file, each filter with the settings of the document's
    language; records drops per filter, and documents per language before (`language:<code>`) and after
    (`kept_language:<code>`) the chain."""

    name = "🔻 quality filters"
    type = "🔻 - FILTER"

    def __init__(self, cfg: BuildConfig, files: list[InputFile], rejects: str, counts_dir: str):
        super().__init__()
        self.cfg, self.files, self.rejects, self.counts_dir = cfg, files, rejects, counts_dir

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        cfg = self.cfg
        src = {s.name: s for s in cfg.sources}[self.files[rank].source]
        specs = cfg.filters_for(src)
        labelled = [(filter_label(spec, i), chain_filter(spec, cfg.word_tokenizer, cfg.language_filters, self.rejects, i))
                    for i, spec in enumerate(specs)]
        if cfg.langid.enabled or src.language:  # a declared language needs no model
            writer = RejectsWriter(os.path.join(self.rejects, "langid"))
            labelled.insert(0, ("langid", IdentifyLanguage(cfg.langid, src, writer, tuple(cfg.language_filters))))
        for _, flt in labelled:
            data = flt.run(data, rank, world_size)
        kept: dict[str, int] = {}
        for doc in data:
            lang = doc.metadata.get("language")
            if lang:
                kept[lang] = kept.get(lang, 0) + 1
            yield doc
        counts = {}
        for label, flt in labelled:
            st = stats_of(flt)
            counts[label] = st.get("dropped", 0)
            for k, v in st.items():
                if k.startswith("dropped_"):
                    counts[f"{label}:{k[len('dropped_'):]}"] = v
                elif k.startswith("language:"):
                    counts[k] = v
        counts.update({f"kept_language:{k}": v for k, v in sorted(kept.items())})
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


class PrepareTokenizer(PipelineStep):
    """Copies the configured tokenizer.json into the dataset, or trains a byte-level BPE on the first
    `tokenizer.train_max_docs` kept documents in priority order, re-read from the input with the filter
    and dedup decisions applied (with the chat template's control tokens as special tokens when there
    are chat sources)."""

    name = "🔤 tokenizer"

    def __init__(self, cfg: BuildConfig, out_path: str, rereader: list[PipelineStep], n_ranks: int):
        super().__init__()
        self.cfg, self.out_path, self.rereader, self.n_ranks = cfg, out_path, rereader, n_ranks

    def _texts(self):
        left = self.cfg.tokenizer.train_max_docs
        for r in range(self.n_ranks):
            data = None
            for step in self.rereader:
                data = step.run(data, r, self.n_ranks)
            for doc in data:
                if left <= 0:
                    return
                left -= 1
                yield doc.text

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        tc = self.cfg.tokenizer
        if tc.path:
            if os.path.isfile(tc.path):
                with open(tc.path, "rb") as f:
                    atomic.write_bytes(self.out_path, f.read())
            else:
                atomic.write_bytes(self.out_path, load_tokenizer(tc.path).to_str().encode())
        else:
            train_bpe(self._texts(), tc.vocab_size, tc.eos_token, self.out_path, self._special_tokens())
        if self.cfg.chat_template:
            check_special_tokens(load_tokenizer(self.out_path), self._special_tokens(), f"tokenizer {tc.path}")

    def _special_tokens(self) -> list[str]:
        """tokenizer.special_tokens, then the chat template's control tokens (single tokens in a trained BPE)."""
        chat = template_special_tokens(load_template(self.cfg.chat_template)) if self.cfg.chat_template else []
        return list(dict.fromkeys([*self.cfg.tokenizer.special_tokens, *chat]))
