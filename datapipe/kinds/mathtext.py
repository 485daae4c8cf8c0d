"""Formulas in math text: where they are, kept byte for byte by normalisation, masked from the prose rules,
and measured as a math-density signal.

Formulas (`spans`): MathML `<math>…</math>`; LaTeX math environments (`equation`, `align`, `gather`,
`multline`, `eqnarray`, `math`, `displaymath`, `flalign`, `alignat`, with or without `*`); `$$…$$`, `\\[…\\]`,
`\\(…\\)`; inline `$…$` by pandoc's rule (`tex_math_dollars`): the opening `$` has a non-space character
right after it, the closing one a non-space character right before it and no digit right after it, with
no line break between them and `\\$` never a delimiter, so that "$5 and $10" stays prose.

`mask(text)`: each formula becomes `formulaN` (N its number in the document, so that no two masked
formulas make a repeated line or n-gram), followed by the formula's last punctuation mark when it ends
with one (`$$x = 1.$$` → `formula3.`), so a sentence ending in a formula still ends in a full stop for the
line-punctuation rules. The prose filters of a math source judge the masked text (`Masked`); the text
kept and written is the original.

`density(text)` → (math_density, formulas): the share of characters that are math, those inside formulas
plus, outside them, LaTeX commands (`\\frac`), Unicode math symbols (category Sm) and Greek letters.
"""
from __future__ import annotations

import re
import unicodedata
from collections import OrderedDict

from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter

_ENVS = "equation|align|gather|multline|eqnarray|math|displaymath|flalign|alignat"
FORMULA = re.compile(
    r"<math\b[^>]*>.*?</math\s*>"
    r"|\\begin\{(" + _ENVS + r")(\*?)\}.*?\\end\{\1\2\}"
    r"|\$\$.+?\$\$"
    r"|\\\[.+?\\\]"
    r"|\\\(.+?\\\)"
    r"|(?<![\\$])\$(?=[^\s$])(?:[^$\n\\]|\\.)+?(?<=\S)(?<!\\)\$(?![\d$])",
    re.S | re.I)
_TRAILING_PUNCT = re.compile(r"([.,;:!?])\s*(?:\$\$|\\\]|\\\)|\$|\\end\{[^}]*\}|</math\s*>)\Z", re.I)
_COMMAND = re.compile(r"\\[A-Za-z]+")
_CACHE_MAX = 256


def spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in FORMULA.finditer(text)]


def _is_math_char(c: str) -> bool:
    return unicodedata.category(c) == "Sm" or "\u0370" <= c <= "\u03ff"


def density(text: str) -> tuple[float, int]:
    """(share of math characters, number of formulas); see the module doc."""
    if not text:
        return 0.0, 0
    found = spans(text)
    inside = sum(b - a for a, b in found)
    outside, prev = [], 0
    for a, b in found:
        outside.append(text[prev:a])
        prev = b
    outside.append(text[prev:])
    rest = "".join(outside)
    commands = sum(len(m) for m in _COMMAND.findall(rest))
    symbols = sum(map(_is_math_char, rest)) if not rest.isascii() else 0
    return round(min(1.0, (inside + commands + symbols) / len(text)), 4), len(found)


def mask(text: str) -> str:
    parts, prev = [], 0
    for k, m in enumerate(FORMULA.finditer(text), start=1):
        p = _TRAILING_PUNCT.search(m.group())
        parts += [text[prev:m.start()], f"formula{k}{p.group(1) if p else ''}"]
        prev = m.end()
    return "".join(parts) + text[prev:] if parts else text


def normalize_outside(text: str, normalize) -> str:
    """`normalize(segment)` applied to the text between formulas; the formulas kept byte for byte."""
    parts, prev = [], 0
    for a, b in spans(text):
        parts += [normalize(text[prev:a]), text[a:b]]
        prev = b
    parts.append(normalize(text[prev:]))
    return "".join(parts)


class Masker:
    """`mask` with a small cache: the filters of one chain see each document in turn."""

    def __init__(self):
        self._cache: OrderedDict[str, str] = OrderedDict()

    def __call__(self, text: str) -> str:
        hit = self._cache.get(text)
        if hit is None:
            hit = self._cache[text] = mask(text)
            if len(self._cache) > _CACHE_MAX:
                self._cache.popitem(last=False)
        return hit


class Masked(BaseFilter):
    """Filter `inner` (a prose rule, language ID) judging the document with its formulas masked; rejects
    and what passes keep the original text. `inner` must not rewrite text (the config refuses C4's line
    rules on math sources)."""

    def __init__(self, inner: BaseFilter, masker: Masker):
        super().__init__(inner.exclusion_writer)
        self.inner, self.masker = inner, masker
        self.name, self.type = inner.name, inner.type
        self.stats = inner.stats  # counts the inner filter keeps itself (languages) land in the same place

    def filter(self, doc):
        original = doc.text
        doc.text = masked = self.masker(original)
        try:
            result = self.inner.filter(doc)
            rewritten = doc.text != masked
        finally:
            doc.text = original
        if rewritten:
            raise RuntimeError(f"filter {self.inner.name!r} rewrote a math document's masked text; only filters "
                               "that judge without rewriting can run on math sources")
        return result


class MathAnnotate(PipelineStep):
    """Stores `math_density` and `formulas` in each document's metadata and counts formulas."""

    name = "∑ math density"
    type = "✂️ - FORMAT"

    def run(self, data, rank: int = 0, world_size: int = 1):
        for doc in data:
            doc.metadata["math_density"], doc.metadata["formulas"] = density(doc.text)
            self.stat_update("formulas", value=doc.metadata["formulas"])
            yield doc


class MathDensityFilter(BaseFilter):
    """`type: math_density`: keeps math documents whose density is within [min_density, max_density]."""

    name = "∑ math density"

    def __init__(self, min_density: float = 0.0, max_density: float = 1.0, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.min_density, self.max_density = min_density, max_density

    def filter(self, doc):
        d = doc.metadata.get("math_density")
        if d is None:
            d = density(doc.text)[0]
        if d < self.min_density:
            return False, "below_min_density"
        if d > self.max_density:
            return False, "above_max_density"
        return True
