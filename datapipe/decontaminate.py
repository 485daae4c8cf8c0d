"""Decontamination against evaluation tasks: an index of the word n-grams of every eval item (its own
text plus its gold answer) and the datatrove filter step that drops training documents sharing one.

The prompt labels the bundled tasks put around an item (`Question:`, `Goal:` at a line start, the final
`Answer:` line) are removed first: they are template, not text a contaminated document would contain.

As GPT-3 (appendix C) and datatrove's `NGramsDecontIndexer` / `NGramsDecontFilter`: text goes through
datatrove's `simplify_text` (lowercase, punctuation → spaces, numbers → 0, diacritics stripped,
whitespace collapsed), words are what lies between spaces, and each n-gram (its words joined by one
space) is hashed with xxh64. An item shorter than n words yields no n-gram at all in datatrove; here it
is indexed whole, as one shorter gram, when it has at least `min_words` words (GPT-3's smallest n, 8),
and skipped below that (such short texts are everywhere). Checking a document costs one xxh64 and one
dict lookup per n-word window, plus one dict lookup per word for the few shorter grams (found by their
first word). The index is built once per process. Words in scripts written without spaces (Chinese,
Japanese, Thai) are segmented by `datapipe.segment`, the split the filters and MinHash use, so an n-gram
of such text is n words, not n clauses (ASCII text skips the check).
"""
from __future__ import annotations

import os
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate

import xxhash
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.writers.disk_base import DiskWriter
from datatrove.utils.text import TextNormConfig, simplify_text
from loguru import logger

from datapipe.config import DecontaminateConfig
from datapipe.segment import NO_SPACE_RE, has_no_space_script, segment
from datapipe.workfiles import atomic_json
from storage.evaltasks import Item, load_task

NGRAM_SEED = 0
_NO_DIACRITICS = TextNormConfig(norm_unicode_diacritics=False)
_PROMPT_LABELS = re.compile(r"^[ \t]*(?:Question|Goal|Answer):", re.M)


def index_text(item: Item) -> str:
    """The text indexed for an item: its own text and gold answer, prompt labels removed."""
    return _PROMPT_LABELS.sub(" ", f"{item.question} {item.answer}")


def simplify(text: str) -> str:
    """datatrove's `simplify_text` with its default settings, words separated by single spaces.

    Its diacritics pass (a Python loop over every character) only runs on non-ASCII text, where it can
    change something."""
    out = simplify_text(text, _NO_DIACRITICS)
    if not out.isascii():
        out = "".join(c for c in unicodedata.normalize("NFD", out) if unicodedata.category(c) != "Mn")
        out = " ".join(out.split())  # a lone combining mark between spaces leaves two spaces
        if NO_SPACE_RE.search(out):
            out = " ".join(w for c in out.split(" ") for w in (segment(c) if has_no_space_script(c) else (c,)))
    return out


def ngram_hash(gram: str) -> int:
    return xxhash.xxh64_intdigest(gram, seed=NGRAM_SEED)


def _split(norm: str) -> tuple[list[str], list[int]]:
    """Words of a simplified text and their start offsets; word i..j-1 is norm[starts[i]:starts[j] - 1]."""
    words = norm.split(" ")
    return words, list(accumulate((len(w) + 1 for w in words), initial=0))


@dataclass
class DecontIndex:
    """Hashes of eval-item grams, per gram length (n, plus the lengths of short items indexed whole),
    each mapped to the first (task, item id) that holds it."""
    n: int
    min_words: int
    tables: dict[int, dict[int, tuple[str, str]]] = field(default_factory=dict)
    short_firsts: dict[str, set[int]] = field(default_factory=dict)  # first word -> lengths of short grams
    indexed: Counter = field(default_factory=Counter)  # items per task
    skipped: Counter = field(default_factory=Counter)  # items per task below min_words

    def add(self, task: str, item_id: str, text: str) -> None:
        norm = simplify(text)
        n_words = len(norm.split(" ")) if norm else 0
        if n_words < self.min_words:
            self.skipped[task] += 1
            return
        k = min(self.n, n_words)
        table = self.tables.setdefault(k, {})
        words, starts = _split(norm)
        for i in range(n_words - k + 1):
            table.setdefault(ngram_hash(norm[starts[i]:starts[i + k] - 1]), (task, item_id))
        if k < self.n:
            self.short_firsts.setdefault(words[0], set()).add(k)
        self.indexed[task] += 1

    def match(self, text: str) -> tuple[str, str, str] | None:
        """(task, item id, n-gram text) of the first n-gram of `text` in the index, else of the first
        short (whole-item) gram, or None."""
        norm = simplify(text)
        if not norm:
            return None
        words, starts = _split(norm)
        n, hash_, count = self.n, ngram_hash, len(words)
        if self.n in self.tables:
            get = self.tables[n].get
            for i in range(count - n + 1):
                hit = get(hash_(norm[starts[i]:starts[i + n] - 1]))
                if hit is not None:
                    return hit[0], hit[1], norm[starts[i]:starts[i + n] - 1]
        firsts = self.short_firsts
        if firsts:
            for i, w in enumerate(words):
                for k in firsts.get(w, ()):
                    if i + k <= count:
                        gram = norm[starts[i]:starts[i + k] - 1]
                        hit = self.tables[k].get(hash_(gram))
                        if hit is not None:
                            return hit[0], hit[1], gram
        return None


_CACHE: dict[tuple, DecontIndex] = {}


def _spec_key(spec: str) -> tuple:
    """A task spec plus, for a task file, its size and mtime (an edited file is indexed again)."""
    path = spec.rpartition("=")[2].strip()
    st = os.stat(path) if os.path.isfile(path) else None
    return (spec, st.st_size, st.st_mtime_ns) if st else (spec,)


def load_index(cfg: DecontaminateConfig) -> DecontIndex:
    """The index of `cfg.tasks` (each item's `index_text`), built once per process."""
    key = (tuple(map(_spec_key, cfg.tasks)), cfg.n_grams, cfg.min_words)
    if key not in _CACHE:
        index = DecontIndex(cfg.n_grams, cfg.min_words)
        for spec in cfg.tasks:
            task = load_task(spec)
            for item in task.items:
                index.add(task.name, item.item_id, index_text(item))
            if index.skipped[task.name]:
                logger.warning(f"decontaminate: {index.skipped[task.name]} of {len(task.items)} items of task "
                               f"{task.name!r} have fewer than {cfg.min_words} words and are not indexed")
        _CACHE[key] = index
    return _CACHE[key]


class Decontaminate(BaseFilter):
    """Drops documents holding an indexed eval-task gram; the reject's metadata names the task, the item
    and the matched (simplified) n-gram. Counts per task go to `counts_dir/{rank:05d}.json`."""

    name = "🦠 decontaminate"
    type = "🦠 - DECONT"

    def __init__(self, cfg: DecontaminateConfig, counts_dir: str, exclusion_writer: DiskWriter | None = None):
        super().__init__(exclusion_writer)
        self.cfg, self.counts_dir = cfg, counts_dir
        self.by_task: Counter = Counter()
        self._index: DecontIndex | None = None

    def __getstate__(self):  # workers get the config, not the index (each builds or reuses its own)
        return {**self.__dict__, "_index": None}

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if self._index is None:
            self._index = load_index(self.cfg)
        hit = self._index.match(doc.text)
        if hit is None:
            return True
        task, item_id, gram = hit
        doc.metadata.update({"filter": "decontaminate", "contaminated_task": task, "contaminated_item": item_id,
                             "contaminated_ngram": gram})
        self.by_task[task] += 1
        return False, "contaminated"

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        self.by_task = Counter()
        yield from super().run(data, rank, world_size)
        atomic_json(os.path.join(self.counts_dir, f"{rank:05d}.json"),
                    {"decontaminated": sum(self.by_task.values()), "by_task": dict(sorted(self.by_task.items()))})
