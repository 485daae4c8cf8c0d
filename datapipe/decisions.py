"""Per-task keep decisions, so that no stage needs a copy of the text: the scan stage records which
documents passed the filters; dedup stages write removal lists; later stages re-read the original input
and apply them.

A task's documents are numbered twice: `pos`, the position in the stream after reading and normalising
(both deterministic, so a re-read reproduces it), and the post-filter index, the position among the
documents that passed the filters (the numbering of exact and near-duplicate removals, and of MinHash
signature files). `kept/{rank}.npy` maps post-filter index to `pos`; `edits/{rank}.json.gz` holds the
rewrites filters made (C4 drops lines, redaction) as line references, not copies; `langs/{rank}.json.gz` the
labels of the kept documents (language, script, score, settings; programming language; math density;
a classifier's `quality_score`),
which a re-read puts back in their metadata, so the duplicates' and decontamination's rejects carry them
too, and hold the text the filters passed on.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections import deque

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from datapipe.dedup.clusters import near_removals
from datapipe.dedup.exact import exact_removals
from datapipe.workfiles import atomic_npy, load_npy
from storage import atomic


def kept_path(work: str, rank: int) -> str:
    return os.path.join(work, "kept", f"{rank:05d}.npy")


def line_edit(orig: str, final: str) -> list | str:
    """How a filter rewrote a document (C4 drops and strips lines; redaction replaces a few lines): the
    final text as parts, each the index k of an original line (stripped), ~k (the line as it was: code
    keeps its indentation) or a literal line; the whole final text when that is no shorter."""
    lines, parts, j = orig.splitlines(), [], 0
    for f in final.split("\n"):
        k = j
        while k < len(lines) and lines[k].strip() != f and lines[k] != f:
            k += 1
        if k < len(lines):
            parts.append(k if lines[k].strip() == f else ~k)
            j = k + 1
        else:
            parts.append(f)
    if apply_edit(orig, parts) != final or sum(isinstance(p, str) for p in parts) > len(parts) // 2:
        return final
    return parts


def apply_edit(orig: str, edit: list | str) -> str:
    if isinstance(edit, str):
        return edit
    lines = orig.splitlines()
    return "\n".join(p if isinstance(p, str) else lines[p].strip() if p >= 0 else lines[~p] for p in edit)


# what the scan stage learnt about a kept document that a re-read puts back in its metadata
_LABELS = ("language", "script", "language_score", "language_settings", "code_language", "math_density", "formulas",
           "quality_score")


def langs_path(work: str, rank: int) -> str:
    return os.path.join(work, "langs", f"{rank:05d}.json.gz")


def edits_path(work: str, rank: int) -> str:
    return os.path.join(work, "edits", f"{rank:05d}.json.gz")


class FilterAndRecord(PipelineStep):
    """Runs the filter chain and records, for every document that passes, its `pos` (`kept/RANK.npy`)
    and, when a filter rewrote its text, the edit (`edits/RANK.json.gz`), so a re-read gets the same text."""

    name = "📝 filter + kept positions"

    def __init__(self, filters: PipelineStep, work: str):
        super().__init__()
        self.filters, self.work = filters, work

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        pending: deque[tuple[Document, str]] = deque()

        def numbered():
            for doc in data:
                pending.append((doc, doc.text))
                yield doc

        kept, edits, labels, pos = [], [], [], -1
        for doc in self.filters.run(numbered(), rank, world_size):
            while True:  # filters keep the order; the documents before this one were dropped
                pos += 1
                seen, orig = pending.popleft()
                if seen is doc:
                    break
            if doc.text != orig:
                edits.append([len(kept), line_edit(orig, doc.text)])
            kept.append(pos)
            labels.append([doc.metadata.get(k) for k in _LABELS])
            yield doc
        atomic_npy(kept_path(self.work, rank), np.asarray(kept, dtype=np.uint32))
        atomic.write_bytes(langs_path(self.work, rank), gzip.compress(json.dumps(labels).encode(), 1, mtime=0))
        atomic.write_bytes(edits_path(self.work, rank), gzip.compress(json.dumps(edits).encode(), 1, mtime=0))


class Select(PipelineStep):
    """On a re-read (reader + normalise), keeps what the earlier stages kept: documents that passed the
    filters and are neither exact nor near duplicates. Duplicates go to the exclusion writers (when given)
    with their reason."""

    name = "✅ apply decisions"
    type = "🫂 - DEDUP"

    def __init__(self, work: str, exact_parts: int, near_dir: str | None, exact_writer=None, near_writer=None):
        super().__init__()
        self.work, self.exact_parts, self.near_dir = work, exact_parts, near_dir
        self.exact_writer, self.near_writer = exact_writer, near_writer

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with contextlib.ExitStack() as stack:
            writers = [w if w is None else stack.enter_context(w) for w in (self.exact_writer, self.near_writer)]
            yield from self._select(data, rank, *writers)

    def _select(self, data: DocumentsPipeline, rank: int, exact_writer, near_writer) -> DocumentsPipeline:
        kept = load_npy(kept_path(self.work, rank), np.uint32).tolist()  # int compares per record, not numpy scalars
        with gzip.open(edits_path(self.work, rank)) as f:
            edits = dict(json.load(f))
        labels = []
        if os.path.exists(langs_path(self.work, rank)):
            with gzip.open(langs_path(self.work, rank)) as f:
                labels = json.load(f)
        exact = set(exact_removals(os.path.join(self.work, "exact"), rank, self.exact_parts).tolist())
        near = set(near_removals(self.near_dir, rank).tolist())
        i = 0
        for pos, doc in enumerate(data):
            if i >= len(kept):
                break
            if pos != kept[i]:
                continue
            idx, i = i, i + 1
            if idx < len(labels):
                doc.metadata.update((k, v) for k, v in zip(_LABELS, labels[idx]) if v is not None)
            if idx in edits:  # the text the filters passed on (C4's line rules, redaction), also in rejects
                doc.text = apply_edit(doc.text, edits[idx])
            for removed, writer, label, reason in ((exact, exact_writer, "exact_dup", "exact duplicate"),
                                                   (near, near_writer, "near_dup", "near duplicate")):
                if idx in removed:
                    self.stat_update(f"dropped_{label}")
                    if writer is not None:
                        doc.metadata.update(filter=label, filter_reason=reason)
                        writer.write(doc, rank)
                    break
            else:
                self.stat_update("forwarded")
                yield doc
        if i != len(kept):
            raise RuntimeError(f"task {rank}: the input changed since it was filtered ({i} of {len(kept)} kept "
                               "documents found again); rebuild with --fresh")
