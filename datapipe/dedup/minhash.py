"""MinHash near-dedup on datatrove's stages, with a faster signature step, verified candidate pairs and
priority-aware keeps.

- `minhash_config` maps our settings (n-grams, bands × rows, hash width) onto datatrove's MinhashConfig.
- `FastMinhashSignature` is datatrove's `MinhashDedupSignature` with faster shingling and writing:
  `simplify` (datatrove's `simplify_text`, the same output, without its per-character Python loop on
  ASCII text), our `FastWordTokenizer` split memoised per whitespace chunk instead of spaCy's (a chunk in
  a script written without spaces, Chinese or Japanese say, segmented into words by `datapipe.segment`
  for the document's language, so shingles are word n-grams in every script), xxhash
  called directly on the joined n-grams, the permutations as one transposed numpy product with a
  Mersenne-prime fold instead of `%`, and records written per batch and sorted with `lexsort`. Wherever
  the two word splits agree it writes the same signature files; tests/datapipe/test_datapipe_minhash.py
  and tools/bench/bench_dedup.py compare whole runs of both steps, document for document. With
  `sketch_folder` it also writes each task's verification sketches (`datapipe.dedup.verify`).
Code (documents with a `code_language`) is shingled as code instead: n-grams of its tokens, comments left
out, identifiers by their pattern of use (`datapipe.kinds.codetok`).
Clusters are found and resolved by `datapipe.dedup.clusters` (partitioned, priority keep).
"""
from __future__ import annotations

import unicodedata

import numpy as np
import xxhash
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import MONTHS_PATTERN, NUMBERS_PATTERN, PUNCTUATION_TRANS, WEEKDAYS_PATTERN, TextNormConfig
from datatrove.utils.typeshelper import StatHints

from datapipe.config import MinhashSettings
from datapipe.dedup.verify import SketchWriter
from datapipe.kinds.codetok import shingles as code_shingles
from datapipe.kinds.codetok import tokens as code_tokens
from datapipe.segment import has_no_space_script, japanese_words, segment
from datapipe.wordtok import _EXC, tokenize_words

_MERSENNE = np.uint64((1 << 61) - 1)
_BATCH = 2048  # documents per write of the signature records
_COLS = 4096  # shingles per block of the permutation product (bounded scratch buffers)
_MEMO_MAX = 1_000_000  # whitespace chunks remembered by words_of
_WORDS: dict[str, str] = {}  # chunk → its words joined by spaces (the chunk itself when it is one word)
_SPLIT: set[str] = set()  # the chunks of _WORDS our tokenizer splits
_NO_SHINGLES = np.zeros((0, 1), dtype=np.uint64)
_NO_SPACE: set[str] = set()  # the chunks of _SPLIT in a script without spaces: segmented per language


def minhash_config(s: MinhashSettings) -> MinhashConfig:
    return MinhashConfig(n_grams=s.n_grams, num_buckets=s.bands, hashes_per_bucket=s.rows, seed=s.seed,
                         hash_config=HashConfig(precision=s.hash_bits, hash_fc=s.hash_fc))


def simplify(text: str, norm: TextNormConfig, split: bool = False) -> str | list[str]:
    """datatrove's `simplify_text(text, norm)`, character for character (or, with `split`, its
    `.split()`): the same steps and patterns, but whitespace runs collapse with `str.split` (the
    characters `re`'s `\\s` matches) and the diacritics step (a Python loop per character there) only runs
    on non-ASCII text, as one `translate` that drops the combining marks (category Mn) present."""
    if norm.lowercase:
        text = text.lower()
    if norm.norm_numbers:
        text = NUMBERS_PATTERN.sub("0", text)
    if norm.norm_weekdays:
        text = WEEKDAYS_PATTERN.sub("WEEKDAY", text)
    if norm.norm_monthnames:
        text = MONTHS_PATTERN.sub("MONTH", text)
    if norm.remove_punctuation:
        text = text.translate(PUNCTUATION_TRANS)
    if split and (text.isascii() or not norm.norm_unicode_diacritics):
        return text.split()
    if norm.norm_whitespace:
        text = " ".join(text.split())
    if norm.norm_unicode_diacritics and not text.isascii():
        text = unicodedata.normalize("NFD", text)
        marks = [ord(c) for c in set(text) if unicodedata.category(c) == "Mn"]
        if marks:
            text = text.translate(dict.fromkeys(marks))
    return text.split() if split else text.strip()


def words_of(chunks: list[str], language: str | None = None) -> list[str]:
    """`tokenize_words(" ".join(chunks), language)` with English's rules outside scripts without spaces,
    which splits each whitespace chunk on its own: here each distinct chunk is tokenized once per process
    (a plain ASCII word, which it keeps whole, without a call), so a document costs a few set operations,
    plus a join and split if one of its chunks splits. Chunks in a script without spaces (never
    remembered: their words depend on the language, and they are long) are segmented per document; a
    Japanese document's whole text goes to SudachiPy."""
    distinct = set(chunks)
    new = distinct.difference(_WORDS)
    if new:
        if len(_WORDS) > _MEMO_MAX:
            _WORDS.clear()
            _SPLIT.clear()
            _NO_SPACE.clear()
            new = distinct
        for c in new:
            if c.isascii() and (c.isalpha() or c.isdigit()) and c not in _EXC:
                _WORDS[c] = c
            elif has_no_space_script(c):
                _WORDS[c] = ""
                _SPLIT.add(c)
                _NO_SPACE.add(c)
            else:
                words = tokenize_words(c)
                _WORDS[c] = " ".join(words)
                if words != [c]:
                    _SPLIT.add(c)
    if distinct.isdisjoint(_SPLIT):
        return chunks
    if distinct.isdisjoint(_NO_SPACE):
        return " ".join(map(_WORDS.__getitem__, chunks)).split()
    if language == "ja":  # SudachiPy reads the whole text, as datatrove's jpn_Jpan does (2x fewer seconds)
        return japanese_words(" ".join(chunks))
    out: list[str] = []
    for c in chunks:
        out += segment(c, language) if c in _NO_SPACE else _WORDS[c].split()
    return out


class FastMinhashSignature(MinhashDedupSignature):
    """`MinhashDedupSignature(language="en")`, faster: the same signature files wherever our word split
    equals spaCy's; with `sketch_folder`, also each document's verification sketch. `spacy_words` keeps
    datatrove's shingling (spaCy's word split) and only speeds up the rest."""

    name = "🎯 MinHash stage 1 (fast)"

    def __init__(self, output_folder, config: MinhashConfig | None = None, sketch_folder: str | None = None,
                 spacy_words: bool = False):
        super().__init__(output_folder, config=config)
        self.sketch_folder, self.spacy_words = sketch_folder, spacy_words
        self._scratch = None  # permutation parameters as columns, and the product's buffers
        hc = self.config.hash_config
        if hc.hash_fc == "xxhash":
            self._hash = xxhash.xxh64_intdigest if hc.precision == 64 else xxhash.xxh32_intdigest
        else:
            self._hash = self._hash_func

    def get_shingles(self, text: str, language: str | None = None) -> np.ndarray:
        if self.spacy_words:
            return super().get_shingles(text)
        words = words_of(simplify(text, self.config.norm_config, split=True), language)
        n = self.config.n_grams
        count = len(words) - n + 1
        if count <= 0:
            return np.zeros((0, 1), dtype=np.uint64)
        grams = map(" ".join, zip(*(words[i:] for i in range(n))))
        return np.fromiter(map(self._hash, grams), dtype=np.uint64, count=count).reshape((-1, 1))

    def minhashes(self, shingles: np.ndarray) -> np.ndarray:
        """`get_signature` as one array (bands x rows values): the minima of ((h a + b) mod 2^64) mod p,
        p = 2^61 - 1, computed in blocks of (permutations) x (shingles) in reused buffers, with the modulo
        as a fold x = (x & p) + (x >> 61), exact after the rare fix of a result in [p, p + 7]."""
        if self._scratch is None:
            a, b = (np.ascontiguousarray(v.reshape(-1, 1)) for v in self.parameters)
            self._scratch = a, b, np.empty(a.size * _COLS, np.uint64), np.empty(a.size * _COLS, np.uint64)
        a, b, buf, buf2 = self._scratch
        h = shingles.reshape(-1)
        out = None
        for s in range(0, len(h), _COLS):
            part = h[s:s + _COLS]
            y, high = (x[:a.size * len(part)].reshape(a.size, len(part)) for x in (buf, buf2))
            np.multiply(a, part, out=y)
            y += b
            np.right_shift(y, np.uint64(61), out=high)
            y &= _MERSENNE
            y += high
            if y.max() >= _MERSENNE:
                y[y >= _MERSENNE] -= _MERSENNE
            if self.config.hash_config.precision == 32:
                y &= np.uint64(self.config.hash_config.max)
            m = y.min(axis=1)
            out = m if out is None else np.minimum(out, m)
        return out.astype(self.config.hash_config.np_dtype)

    def run(self, data, rank: int = 0, world_size: int = 1):
        """datatrove's file layout and record order: per bucket, (rows hashes, doc index) records of the
        documents with at least one shingle, sorted; written per batch, then sorted one bucket at a time."""
        cfg = self.config
        rows = cfg.hashes_per_bucket
        rec = np.dtype([(f"field{i + 1}", f"<{cfg.hash_config.struct_format}") for i in range(rows)]
                       + [(f"field{rows + 1}", "<I")])
        names = [f"bucket_{bi:03d}/{rank:05d}.minhash.sig" for bi in range(cfg.num_buckets)]
        sketches = SketchWriter(self.sketch_folder, rank, cfg.seed) if self.sketch_folder else None
        with self.track_time():
            outs = [self.output_folder.open(name, mode="wb") for name in names]
            sigs: list[np.ndarray] = []
            idx: list[int] = []
            batch: list[np.ndarray] = []  # every document's shingles, for the sketches

            def flush() -> None:
                if sketches:
                    sketches.add(batch)
                    batch.clear()
                if idx:
                    s = np.stack(sigs)
                    for bi, f in enumerate(outs):
                        r = np.empty(len(idx), dtype=rec)
                        for k in range(rows):
                            r[rec.names[k]] = s[:, bi * rows + k]
                        r[rec.names[rows]] = idx
                        f.write(r.tobytes())
                    sigs.clear()
                    idx.clear()

            for doc_idx, doc in enumerate(data):
                self.stat_update(StatHints.total)
                # RL prompts are exempt (as a document without shingles is): short templated questions that
                # differ in their numbers, which simplify() maps to 0, would all be one cluster
                meta = doc.metadata
                if meta.get("kind") == "prompts":
                    shingles = _NO_SHINGLES
                elif "code_language" in meta:
                    shingles = code_shingles(code_tokens(doc.text, meta["code_language"]), self.config.n_grams)
                else:
                    shingles = self.get_shingles(doc.text, meta.get("language"))
                if sketches:
                    batch.append(shingles)
                if shingles.size:
                    sigs.append(self.minhashes(shingles))
                    idx.append(doc_idx)
                if len(idx) >= _BATCH or len(batch) >= _BATCH:
                    flush()
            flush()
            for f in outs:
                f.close()
            for name in names:
                with self.output_folder.open(name, mode="rb") as f:
                    r = np.frombuffer(f.read(), dtype=rec)
                r = r[np.lexsort([r[k] for k in reversed(rec.names)])]
                with self.output_folder.open(name, mode="wb") as f:
                    f.write(r.tobytes())
            if sketches:
                sketches.close()
