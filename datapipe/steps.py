"""The build's own datatrove steps: per-source filter chains, per-task counts, and the one-task stages
(near-dup cluster resolution, tokenizer training).

One-task stages are plain (non-generator) `run` methods, so they also run under the Slurm and Ray
executors as ordinary tasks chained with `depends`.
"""
from __future__ import annotations

import os

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter

from storage.chat import load_template, template_special_tokens
from datapipe.config import BuildConfig
from datapipe.filters import chain_filter, filter_label
from datapipe.kinds import licenses
from datapipe.kinds.codelang import IdentifyCodeLanguage
from datapipe.kinds.mathtext import MathAnnotate, Masked, Masker
from datapipe.kinds.redact import Redact, Redactor
from datapipe.langid import IdentifyLanguage
from datapipe.quality.qfilter import ClassifierFilter
from datapipe.rejects import RejectsWriter
from datapipe.inputs import InputFile
from datapipe.tokenize import check_special_tokens, load_tokenizer, train_bpe
from datapipe.workfiles import atomic_json, calibration_path
from storage import atomic


def stats_of(step: PipelineStep) -> dict[str, int]:
    return {k: int(v.total) for k, v in step.stats.stats.items()}


# per-task counts kept under their own names (the rest of a step's dropped_* stats become "<label>:<reason>")
COUNT_PREFIXES = ("language:", "kept_language:", "code_language:", "kept_code_language:", "license:",
                  "kept_license:", "redacted", "formulas", "kept_math_density:", "quality_")


class PerSourceFilters(PipelineStep):
    """The scan stage's chain for the source of this task's file, by the source's kind:
    - web: language ID (unless `langid.enabled` is false and the source declares no language), then the
      filter chain, each filter with the settings of the document's language;
    - code: the programming language (`datapipe.kinds.codelang`), redaction, the chain (The Stack's rules);
    - math: redaction (when configured), math density, language ID and the chain on the text with formulas
      masked (`datapipe.kinds.mathtext`).
    A source with `redact` (a code source by default) is redacted first, so every reject is redacted.
    Records drops per filter and documents per language (`language:`, `code_language:`) before and after
    (`kept_...`) the chain, licences, redactions and formulas, and a classifier's score histogram
    (`quality_...`). `rejects` None: no rejects written (the calibrate stage runs a chain's first steps)."""

    name = "🔻 quality filters"
    type = "🔻 - FILTER"

    def __init__(self, cfg: BuildConfig, files: list[InputFile], rejects: str | None, counts_dir: str | None,
                 work: str | None = None):
        super().__init__()
        self.cfg, self.files, self.rejects, self.counts_dir, self.work = cfg, files, rejects, counts_dir, work

    def _writer(self, name: str) -> RejectsWriter | None:
        return RejectsWriter(os.path.join(self.rejects, name)) if self.rejects else None

    def _chain(self, src) -> list[tuple[str, PipelineStep]]:
        cfg = self.cfg
        labelled = [(filter_label(spec, i),
                     chain_filter(spec, cfg.word_tokenizer, cfg.language_filters, self.rejects, i,
                                  calibration_path(self.work, src.name, i) if self.work else None))
                    for i, spec in enumerate(cfg.filters_for(src))]
        if src.kind != "code" and (cfg.langid.enabled or src.language):  # a declared language needs no model
            labelled.insert(0, ("langid", IdentifyLanguage(cfg.langid, src, self._writer("langid"),
                                                           tuple(cfg.language_filters))))
        if src.kind == "math":  # a classifier reads the formulas too (a math classifier is trained on them)
            masker = Masker()
            labelled = [("math", MathAnnotate())] + [
                (label, flt if isinstance(flt, ClassifierFilter) else Masked(flt, masker)) for label, flt in labelled]
        if src.kind == "code":
            labelled.insert(0, ("codelang", IdentifyCodeLanguage(src.language, src.languages,
                                                                 self._writer("codelang"))))
        redact = cfg.redact_for(src)
        if redact.enabled:
            labelled.insert(0, ("redact", Redact({src.name: Redactor(redact.secrets, redact.emails,
                                                                     redact.ip_addresses)})))
        return labelled

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        src = {s.name: s for s in self.cfg.sources}[self.files[rank].source]
        labelled = self._chain(src)
        for _, flt in labelled:
            data = flt.run(data, rank, world_size)
        kept: dict[str, int] = {}
        for doc in data:
            meta = doc.metadata
            keys = [f"kept_{k}:{meta[k]}" for k in ("language", "code_language") if meta.get(k)]
            keys += [f"kept_license:{lic}" for lic in licenses(meta)]
            if "math_density" in meta:  # a histogram in tenths
                keys.append(f"kept_math_density:{min(int(meta['math_density'] * 10), 9) / 10:.1f}")
            for key in keys:
                kept[key] = kept.get(key, 0) + 1
            yield doc
        counts = {}
        for label, flt in labelled:
            st = stats_of(flt)
            if isinstance(flt, BaseFilter):
                counts[label] = st.get("dropped", 0)
            for k, v in st.items():
                if k.startswith("dropped_"):
                    counts[f"{label}:{k[len('dropped_'):]}"] = v
                elif k.startswith(COUNT_PREFIXES):
                    counts[k] = v
        counts.update(sorted(kept.items()))
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
