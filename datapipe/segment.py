"""Scripts: which one a text is written in, and words for the scripts written without spaces.

`script_of(text)` names the dominant script of a text's letters with its ISO 15924 code (`Latn`, `Cyrl`,
`Hani`, `Jpan` for Han mixed with kana, `Hang`, `Thai`, ...; `Zyyy` when it has no letters), counted in
one regex pass.

`segment(chunk, language)` splits a whitespace-free chunk that holds characters of a script written
without spaces (`has_no_space_script`) into words, with the segmenter datatrove assigns to the language
(`datatrove/assets/tokenizer_assignment.csv`), called directly instead of through spaCy:
- Han without kana: jieba's dictionary and HMM through `rjieba` (jieba-rs, a Rust port of datatrove's
  jieba); Han in a Japanese document, or any kana: SudachiPy (split mode A, `sudachidict-core`), as
  datatrove's `jpn_Jpan` (spaCy's Japanese tokenizer, mode A);
- Thai: PyThaiNLP's `newmm-safe` (datatrove's `ThaiTokenizer`);
- Lao, Khmer, Myanmar, Tibetan: one token per grapheme cluster (no segmenter is installed for them).
Every segmenter and dictionary is pinned in pyproject.toml, so the same text gives the same words on
every machine; whitespace tokens are dropped.
"""
from __future__ import annotations

import functools

import regex

_NO_SPACE = (r"\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}\p{Tibetan}"
             r"\u3005\u30fc")  # 々 and ー belong to Han/kana words
NO_SPACE_RE = regex.compile(f"[{_NO_SPACE}]")
_KANA = regex.compile(r"[\p{Hiragana}\p{Katakana}]")
_THAI = regex.compile(r"\p{Thai}")
_HAN = regex.compile(r"[\p{Han}\u3005]")

# ISO 15924 code of each script counted by script_of (Hiragana and Katakana are counted as Kana)
_SCRIPTS = {"Latin": "Latn", "Han": "Hani", "Kana": "Kana", "Hangul": "Hang", "Cyrillic": "Cyrl",
            "Arabic": "Arab", "Greek": "Grek", "Hebrew": "Hebr", "Devanagari": "Deva", "Bengali": "Beng",
            "Thai": "Thai", "Tamil": "Taml", "Telugu": "Telu", "Georgian": "Geor", "Armenian": "Armn",
            "Ethiopic": "Ethi", "Gujarati": "Gujr", "Gurmukhi": "Guru", "Kannada": "Knda", "Malayalam": "Mlym",
            "Sinhala": "Sinh", "Khmer": "Khmr", "Lao": "Laoo", "Myanmar": "Mymr", "Tibetan": "Tibt"}
_RUNS = regex.compile("|".join(
    f"(?P<{name}>[\\p{{Hiragana}}\\p{{Katakana}}\\u30fc]+)" if name == "Kana" else f"(?P<{name}>\\p{{{name}}}+)"
    for name in _SCRIPTS))
_LETTER = regex.compile(r"\p{L}")


def script_of(text: str) -> str:
    """ISO 15924 code of the script most of `text`'s letters are in. Han with kana at >= 5 % of the
    Han + kana letters is `Jpan` (Japanese); Hangul with Han is `Hang`; no letters: `Zyyy`."""
    if text.isascii():
        return "Latn" if any(c.isalpha() for c in text) else "Zyyy"
    counts = dict.fromkeys(_SCRIPTS, 0)
    for m in _RUNS.finditer(text):
        counts[m.lastgroup] += m.end() - m.start()
    kana, han = counts.pop("Kana"), counts["Han"]
    if kana and kana >= 0.05 * (han + kana):
        counts["Han"] = 0
        counts["Japanese"] = han + kana
    best = max(counts, key=counts.__getitem__)
    if counts[best] == 0:
        return "Zyyy" if not _LETTER.search(text) else "Zzzz"
    return "Jpan" if best == "Japanese" else _SCRIPTS[best]


def has_no_space_script(chunk: str) -> bool:
    return not chunk.isascii() and NO_SPACE_RE.search(chunk) is not None


@functools.lru_cache(maxsize=1)
def _sudachi():
    from sudachipy import Dictionary, SplitMode

    # only the surface field is loaded: 2.6x faster than the full morpheme records
    return Dictionary(dict="core").tokenizer(mode=SplitMode.A, fields={"surface"})


def japanese_words(text: str) -> list[str]:
    """SudachiPy's words (mode A) of a whole text, whitespace dropped."""
    return [w for w in _japanese(text) if w.strip()]


def _japanese(chunk: str) -> list[str]:
    # SudachiPy refuses inputs over 49,149 bytes: split long chunks at sentence ends
    out: list[str] = []
    for part in _pieces(chunk, 16_000):
        out += [m.surface() for m in _sudachi().tokenize(part)]
    return out


def _pieces(text: str, size: int) -> list[str]:
    if len(text) <= size:
        return [text]
    cuts, start = [], 0
    while len(text) - start > size:
        end = max(text.rfind(p, start, start + size) for p in "。！？.!?")
        end = start + size if end <= start else end + 1
        cuts.append(text[start:end])
        start = end
    return cuts + [text[start:]]


def _chinese(chunk: str) -> list[str]:
    import rjieba

    return rjieba.cut(chunk)


def _thai(chunk: str) -> list[str]:
    from pythainlp.tokenize import word_tokenize

    return word_tokenize(chunk, engine="newmm-safe", keep_whitespace=False)


_GRAPHEMES = regex.compile(r"\X")


def segment(chunk: str, language: str | None = None) -> list[str]:
    """Words of a whitespace-free `chunk` holding characters of a script written without spaces."""
    if _KANA.search(chunk) or (language == "ja" and _HAN.search(chunk)):
        words = _japanese(chunk)
    elif _HAN.search(chunk):
        words = _chinese(chunk)
    elif _THAI.search(chunk):
        words = _thai(chunk)
    else:
        words = _GRAPHEMES.findall(chunk)
    return [w for w in words if w.strip()]
