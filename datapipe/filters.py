"""Build datatrove's quality filters (Gopher, C4, FineWeb, language ID, fastText) and our model-based
`classifier` (datapipe.quality.qfilter) from config specs.

Each filter gets a `datapipe.rejects.RejectsWriter` (datatrove's JsonlWriter) as exclusion writer, so every dropped document lands in
`rejects/<filter>/` with its reason. Filter i of a source's chain is a `PerLanguage` filter: each
document is judged by an instance built for its language settings (`datapipe.langsettings.route`, in
the document's `language_settings` metadata) with that language's word split: our `FastWordTokenizer`
(default) or datatrove's tokenizer for the language (`word_tokenizer: spacy`: spaCy, with jieba for
Chinese and SudachiPy for Japanese). With the fast tokenizer the Gopher repetition rules run as
`FastGopherRepetitionFilter` (integer n-gram ids), and the Gopher quality and C4 rules as
`datapipe.fastfilters`' classes (same rules and results).
"""
from __future__ import annotations

import inspect
import os

import numpy as np
from datatrove.pipeline.filters import (
    C4ParagraphFilter,
    C4QualityFilter,
    FastTextClassifierFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
    LanguageFilter,
)
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.filters.gopher_repetition_filter import find_duplicates
from datatrove.utils.text import split_into_words

from datapipe.filterspec import FilterSpec
from datapipe.fastfilters import FastC4QualityFilter, FastGopherQualityFilter
from datapipe.kinds.codefilter import CodeQualityFilter
from datapipe.kinds.mathtext import MathDensityFilter
from datapipe.langsettings import filter_params
from datapipe.quality.qfilter import ClassifierFilter, check_params
from datapipe.rejects import RejectsWriter
from datapipe.wordtok import ELIDING, FastWordTokenizer
from storage.config import ConfigError

_CLASSES: dict[str, type[BaseFilter]] = {
    "gopher_repetition": GopherRepetitionFilter,
    "gopher_quality": GopherQualityFilter,
    "c4": C4QualityFilter,
    "c4_paragraph": C4ParagraphFilter,
    "fineweb": FineWebQualityFilter,
    "language": LanguageFilter,
    "fasttext": FastTextClassifierFilter,
    "code": CodeQualityFilter,
    "math_density": MathDensityFilter,
    "classifier": ClassifierFilter,
}
_RESERVED = {"exclusion_writer", "language", "model_url"}


class FastGopherRepetitionFilter(GopherRepetitionFilter):
    """datatrove's Gopher repetition rules with n-grams as integer ids instead of joined strings.

    Same checks in the same order. Top n-grams: the most frequent n-gram, ties to the first seen (as
    `Counter.most_common`), length with separators. Duplicate n-grams: datatrove's skip-ahead scan, but
    n-grams are compared as word sequences where datatrove compares their separator-less concatenation
    (so "ab c" and "a bc" no longer collide)."""

    def filter(self, doc):
        text = doc.text
        if not text:
            return False, "empty"
        paragraphs = self.paragraph_exp.split(text.strip())
        paragraphs_duplicates, char_duplicates = find_duplicates(paragraphs)
        if self.dup_para_frac and paragraphs_duplicates / len(paragraphs) > self.dup_para_frac:
            return False, "dup_para_frac"
        if self.dup_para_char_frac and char_duplicates / len(text) > self.dup_para_char_frac:
            return False, "dup_para_char_frac"
        lines = self._line_splitter.split(text)
        line_duplicates, char_duplicates = find_duplicates(lines)
        if self.dup_line_frac and line_duplicates / len(lines) > self.dup_line_frac:
            return False, "dup_line_frac"
        if self.dup_line_char_frac and char_duplicates / len(text) > self.dup_line_char_frac:
            return False, "dup_line_char_frac"
        words = split_into_words(text, self.language)
        if len(words) < 400:  # numpy's per-call cost exceeds the string work on short documents
            return self._ngram_checks_strings(words, text)
        vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
        ids = np.fromiter(map(vocab.__getitem__, words), dtype=np.int64, count=len(words))
        csum = np.concatenate([[0], np.cumsum(np.fromiter(map(len, words), dtype=np.int64, count=len(words)))])
        n_text = len(text)

        cls_cache = {1: ids}

        def classes(n: int) -> np.ndarray:
            """An id per position, equal iff the n words starting there are equal (built from n-1)."""
            if n not in cls_cache:
                prev = classes(n - 1)
                if len(prev) and int(prev.max()) == len(prev) - 1:
                    # every (n-1)-gram distinct (ids 0..k-1 from np.unique): so is every n-gram
                    cls_cache[n] = np.arange(len(prev) - 1)
                else:
                    key = prev[:-1] * (len(vocab) + 1) + ids[n - 1:]
                    cls_cache[n] = np.unique(key, return_inverse=True)[1].reshape(-1)
            return cls_cache[n]

        for n, n_frac in self.top_n_grams:
            if len(words) < n:
                continue
            inv = classes(n)
            counts = np.bincount(inv)
            first = np.full(len(counts), len(inv), dtype=np.int64)
            np.minimum.at(first, inv, np.arange(len(inv)))
            best = counts.max()
            pos = int(first[counts == best].min())
            top_char_length = (int(csum[pos + n] - csum[pos]) + n - 1) * int(best)
            if top_char_length / n_text > n_frac:
                return False, f"top_{n}_gram"
        for n, n_frac in self.dup_n_grams:
            if len(words) < n:
                continue
            if _repeated_chars(classes(n), csum[n:] - csum[:-n], n) / n_text > n_frac:
                return False, f"duplicated_{n}_n_grams"
        return True

    def _ngram_checks_strings(self, words: list[str], text: str):
        from datatrove.pipeline.filters.gopher_repetition_filter import (
            find_all_duplicate,
            find_top_duplicate,
            get_n_grams,
        )

        for n, n_frac in self.top_n_grams:
            n_grams = get_n_grams(words, n)
            if n_grams and find_top_duplicate(n_grams) / len(text) > n_frac:
                return False, f"top_{n}_gram"
        for n, n_frac in self.dup_n_grams:
            if find_all_duplicate(words, n) / len(text) > n_frac:
                return False, f"duplicated_{n}_n_grams"
        return True


def _repeated_chars(inv: np.ndarray, lens: np.ndarray, n: int) -> int:
    """datatrove's duplicate n-gram scan (`find_all_duplicate`: left to right, an n-gram already seen at a
    visited position counts its characters and skips n positions, any other is recorded and skips one)
    on n-gram classes `inv`, visiting only the positions that can repeat: an n-gram's first occurrence
    never does, so the runs between candidates go into the seen set in one C call."""
    first = np.full(int(inv.max()) + 1, len(inv), dtype=np.int64)
    np.minimum.at(first, inv, np.arange(len(inv)))
    cand = np.flatnonzero(first[inv] < np.arange(len(inv))).tolist()
    if not cand:
        return 0
    inv_l, lens_l = inv.tolist(), lens.tolist()
    seen: set[int] = set()
    repeated, idx = 0, 0
    for c in cand:
        if c < idx:  # inside a skipped run
            continue
        seen.update(inv_l[idx:c])
        if inv_l[c] in seen:
            repeated += lens_l[c]
            idx = c + n
        else:
            seen.add(inv_l[c])
            idx = c + 1
    return repeated


# datatrove's tokenizer codes where its 639-1 code gives the wrong one (`zh`: spaCy without jieba)
_DATATROVE_CODES = {"zh": "cmn_Hani", "ja": "jpn_Jpan"}


def word_tokenizer(kind: str, language: str = "en"):
    """The `language` argument handed to datatrove filters: our tokenizer for `language`, or the code of
    datatrove's (spaCy's "en")."""
    if kind == "fast":
        return FastWordTokenizer(language)
    from datatrove.utils.word_tokenizers import load_tokenizer_assignments

    code = _DATATROVE_CODES.get(language, language)
    return code if code in load_tokenizer_assignments() else "en"  # a code datatrove has no tokenizer for


def split_language(language: str | None, script: str | None) -> str:
    """The word-split variant for a document: English's rules (exceptions), the eliding languages', the
    Japanese segmenter for Han, or the generic rules (`xx`)."""
    if not language or language == "en":
        return "en"
    if language == "ja" or script == "Jpan":
        return "ja"
    return language if language in ELIDING else "xx"


class PerLanguage(BaseFilter):
    """Filter i of a source's chain: each document is judged by the instance built for its language
    settings and word split (built on first use), so the rejects and counts stay those of filter i."""

    def __init__(self, spec: FilterSpec, kind: str, overrides: dict, exclusion_writer=None):
        super().__init__(exclusion_writer)
        cls = _CLASSES[spec.type]
        self.name, self.type = cls.name, cls.type
        self.spec, self.kind, self.overrides = spec, kind, overrides
        self.inner: dict[tuple[str, str], BaseFilter] = {}

    def filter(self, doc):
        meta = doc.metadata
        lang = meta.get("language") or "en"
        key = (meta.get("language_settings") or "en",
               split_language(lang, meta.get("script")) if self.kind == "fast" else lang)
        flt = self.inner.get(key)
        if flt is None:
            params = filter_params(key[0], self.spec.type, self.spec.params, self.overrides)
            flt = self.inner[key] = build_filter(FilterSpec(self.spec.type, params), word_tokenizer(self.kind, key[1]))
        return flt.filter(doc)


def per_language_params() -> dict[str, set[str]]:
    """Filter types with per-language settings → their parameter names."""
    return {t: set(inspect.signature(_CLASSES[t].__init__).parameters) - {"self"} - _RESERVED
            for t in ("gopher_repetition", "gopher_quality", "c4", "fineweb")}


def _local_model(spec: FilterSpec, where: str) -> str:
    path = spec.params.get("model")
    if not path:
        raise ConfigError(f"{where}: filter {spec.type!r} needs params.model, a local model file")
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: model {path!r} is not a local file; hub names and URLs would need a "
                          "download and datapipe never fetches models at run time. Download the model and give "
                          "its path.")
    return path


def check_specs(specs: list[FilterSpec], where: str) -> None:
    """Unknown parameter names are errors naming the filter and the key; our own filters (code,
    math_density) are built once, so a bad value fails here too. A classifier's model files, labels and
    threshold are checked against the models (datapipe.quality.qfilter.check_params)."""
    for i, spec in enumerate(specs):
        if spec.type == "classifier":
            check_params(spec.params, f"{where}.{i}")
            continue
        cls = _CLASSES[spec.type]
        allowed = set(inspect.signature(cls.__init__).parameters) - {"self"} - _RESERVED
        if spec.type in ("language", "fasttext"):
            allowed.add("model")
            _local_model(spec, f"{where}.{i}")
        for key in spec.params:
            if key not in allowed:
                raise ConfigError(f"{where}.{i}.params: unknown parameter {key!r} for filter {spec.type!r} "
                                  f"(known: {', '.join(sorted(allowed))})")
        if spec.type in ("code", "math_density"):
            try:
                cls(**spec.params)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{where}.{i}.params: {e}") from None


def chain_filter(spec: FilterSpec, kind: str, overrides: dict, rejects_dir: str | None, index: int,
                 calibration: str | None = None) -> BaseFilter:
    """Filter `index` of a chain; its rejects go to `rejects_dir/<index>_<type>/` (None: nowhere). The Gopher,
    C4 and FineWeb rules judge each document with its language's settings (`PerLanguage`); a classifier
    with `keep_top` reads its threshold from `calibration` (datapipe.quality.calibrate)."""
    writer = RejectsWriter(os.path.join(rejects_dir, f"{index}_{spec.type}")) if rejects_dir else None
    if spec.type == "classifier":
        return ClassifierFilter(spec.params, filter_label(spec, index), calibration, writer)
    if spec.type in per_language_params():
        return PerLanguage(spec, kind, overrides, writer)
    return build_filter(spec, word_tokenizer(kind), writer)


def build_filter(spec: FilterSpec, tokenizer, writer=None) -> BaseFilter:
    """One datatrove filter with `spec.params` and the word split `tokenizer`."""
    params = dict(spec.params)
    cls = _CLASSES[spec.type]
    if spec.type == "language":
        model = params.pop("model")
        flt = cls(exclusion_writer=writer, **params)
        flt.model.MODEL_URL = os.path.abspath(model)  # local file: datatrove copies it, no download
        return flt
    if spec.type == "fasttext":
        model = params.pop("model")
        return cls(model_url=os.path.abspath(model), exclusion_writer=writer, **params)
    if "language" in inspect.signature(cls.__init__).parameters:
        params["language"] = tokenizer
    if not isinstance(tokenizer, str):  # the fast path: same rules, less Python per word
        cls = {GopherRepetitionFilter: FastGopherRepetitionFilter, GopherQualityFilter: FastGopherQualityFilter,
               C4QualityFilter: FastC4QualityFilter}.get(cls, cls)
    return cls(exclusion_writer=writer, **params)


def filter_label(spec: FilterSpec, index: int) -> str:
    return f"{index}_{spec.type}"
