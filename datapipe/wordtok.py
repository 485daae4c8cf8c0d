"""Words and sentences for every language: the one word split used by the filters, the MinHash shingles
(`datapipe.dedup.minhash.words_of`) and the decontamination n-grams (`datapipe.decontaminate`).

datatrove's Gopher/C4/FineWeb filters call `load_word_tokenizer("en")`, i.e. `spacy.blank("en")` plus a
sentencizer, once per filter and once per C4 line. `FastWordTokenizer` is a datatrove `WordTokenizer`
that reproduces spaCy's whitespace split, prefix/suffix/infix rules and the common English
contraction exceptions with plain regexes, and memoises recent lines so a chain of filters
tokenizes each line of a document once (C4's rewrite keeps most lines). Its keep decisions are measured
against spaCy's by `tools/bench/bench_dedup.py` (agreement rate reported in docs/benchmarks.md).

Other languages (`FastWordTokenizer(language)`) use the same rules without the English exception table;
French, Italian and Catalan also split an elided article or pronoun off its word (`l'homme` → `l'`,
`homme`), as spaCy's tokenizers for them do (FineWeb-2's stop-word lists count `l'` and `d'`). In every
language, a whitespace chunk holding characters of a script written without spaces (Han, kana, Thai, ...)
is split by that script's segmenter (`datapipe.segment`), so a Chinese sentence is words, not one chunk.
"""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import regex
from datatrove.utils.word_tokenizers import WordTokenizer

from datapipe.segment import has_no_space_script, segment

_QUOTES = "'\"”“`‘´’‚„»«「」『』（）〔〕【】《》〈〉"
_PUNCT = "…,:;!?¿؟¡()\\[\\]{}<>_#*&。？！，、；：～·।،۔؛٪"
_CURRENCY = "$£€¥฿"
_UNITS = ("km|km²|km³|m|m²|m³|dm|cm|mm|ha|µm|nm|yd|in|ft|kg|g|mg|µg|t|lb|oz|m/s|km/h|kmh|mph|hPa|Pa|mbar|mb|MB|"
          "kb|KB|gb|GB|tb|TB|T|G|M|K|%")
_HYPHENS = "---|--|——|—|–|-|~"

_PREFIX = regex.compile(
    rf"^(?:[§%=—–]|\+(?![0-9])|[{_PUNCT}]|\.\.+|……|[{_QUOTES}]|''|US\$|C\$|A\$|[{_CURRENCY}]|[\p{{So}}--[°]])",
    regex.V1)
_SUFFIX = regex.compile(
    rf"(?:[{_PUNCT}]$|……$|\.\.+$|[{_QUOTES}]$|''$|[\p{{So}}--[°]]$|'s$|'S$|’s$|’S$|—$|–$"
    rf"|(?<=[0-9])\+$|(?<=°[FfCcKk])\.$|(?<=[0-9])(?:[{_CURRENCY}])$|(?<=[0-9])(?:{_UNITS})$"
    rf"|(?<=[0-9\p{{Ll}}%²\-\+{_QUOTES}{_PUNCT}])\.$|(?<=\p{{Lu}}\p{{Lu}})\.$)",
    regex.V1)
_INFIX = regex.compile(
    rf"\.\.+|…|[\p{{So}}--[°]]|(?<=[0-9])[+\-\*^](?=[0-9-])|(?<=[\p{{Ll}}{_QUOTES}])\.(?=[\p{{Lu}}{_QUOTES}])"
    rf"|(?<=\p{{L}}),(?=\p{{L}})|(?<=[\p{{L}}0-9])(?:{_HYPHENS})(?=\p{{L}})|(?<=[\p{{L}}0-9])[:<>=/](?=\p{{L}})",
    regex.V1)
_URL = regex.compile(r"^(?:(?:https?|ftp)://\S+|(?:\S+(?::\S*)?@)?(?:[A-Za-z0-9\u00a1-\uffff_-]+\.)+[a-z\u00a1-\uffff]{2,63}(?::\d{2,5})?"
                     r"(?:[/?#]\S*)?)$")
_PLAIN = regex.compile(r"^(?:\p{L}+|[0-9]+)$")
# a word followed by one punctuation mark: the most common chunk that needs splitting
_WORD_PUNCT = regex.compile(r"^(\p{L}+)([,;:!?.])$")

# spaCy 3.8's English tokenizer exceptions (MIT licence): contractions, abbreviations, emoticons.
_EXC: dict[str, list[str]] = json.loads(
    (Path(__file__).parent / "assets" / "en_tokenizer_exceptions.json").read_text(encoding="utf-8"))
SENT_END = set("!.?։؟۔܀܁܂߹।॥၊။።፧፨᙮᜵᜶᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᰻᰼᱾᱿‼‽⁇⁈⁉⸮⸼꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗！．？｡。")


def _split_chunk(s: str, out: list[str], exc: dict[str, list[str]] = _EXC) -> None:
    """spaCy's `_split_affixes` + `_attach_tokens` for one whitespace-free chunk, then its special-case
    matcher, which re-merges affix pieces that spell an exception (e.g. `(` `:` → `(:`)."""
    toks: list[str] = []
    _affix_split(s, toks, exc)
    if len(toks) > 1 and exc:
        i = 0
        while i < len(toks):
            for j in range(min(len(toks), i + 4), i + 1, -1):
                sp = exc.get("".join(toks[i:j]))
                if sp is not None:
                    toks[i:j] = sp
                    i += len(sp) - 1
                    break
            i += 1
    out.extend(toks)


def _affix_split(s: str, out: list[str], exc: dict[str, list[str]]) -> None:
    _special = exc.get
    sp = _special(s)
    if sp is not None:
        out.extend(sp)
        return
    prefixes: list[str] = []
    suffixes: list[str] = []
    last = -1
    while s and len(s) != last:
        last = len(s)
        m = _PREFIX.match(s)
        pre = m.end() if m else 0
        if pre and _special(s[pre:]) is not None:
            prefixes.append(s[:pre])
            s = s[pre:]
            break
        m = _SUFFIX.search(s[pre:])
        suf = (len(s) - pre - m.start()) if m else 0
        if suf and _special(s[:-suf]) is not None:
            suffixes.append(s[-suf:])
            s = s[:-suf]
            break
        if pre and suf and pre + suf <= len(s):
            prefixes.append(s[:pre])
            suffixes.append(s[-suf:])
            s = s[pre:-suf]
        elif pre:
            prefixes.append(s[:pre])
            s = s[pre:]
        elif suf:
            suffixes.append(s[-suf:])
            s = s[:-suf]
        if s and _special(s) is not None:
            break
    out.extend(prefixes)
    if s:
        sp = _special(s)
        if sp is not None:
            out.extend(sp)
        elif _URL.match(s):
            out.append(s)
        else:
            start = 0
            for m in _INFIX.finditer(s):
                if m.start() == 0:
                    continue
                if m.start() != start:
                    out.append(s[start:m.start()])
                if m.start() != m.end():
                    out.append(m.group())
                start = m.end()
            if start < len(s):
                out.append(s[start:])
    out.extend(reversed(suffixes))


_CHUNKS_MAX = 200_000  # chunks remembered per language (<= 64 characters each)
_LINES_MAX = 4096  # the last documents' lines: filters re-split rewritten texts
_LINE_CHARS = 2048  # longer lines are not remembered: the memo stays under ~8M characters of keys
# an elided article or pronoun (French, Italian, Catalan): l'homme, qu'il, dell'anno, d'un
_ELISION = regex.compile(r"^(\p{L}{1,6}['’])(?=\p{L})")
ELIDING = ("fr", "it", "ca")


class _Splitter:
    """One language's word split with its own memos (chunk → tokens, line → tokens)."""

    def __init__(self, language: str):
        self.language = language
        self.exc = _EXC if language == "en" else {}
        self.elision = language in ELIDING
        self.chunks: dict[str, tuple[str, ...]] = {}  # a dict lookup beats even the regex fast path
        self.lines: dict[str, tuple[str, ...]] = {}

    def words(self, text: str) -> list[str]:
        """Tokens of `text`: those of its lines in turn (a chunk never spans a newline), each line's looked
        up in a memo of recent lines, since the chain splits a document, then its C4-rewritten lines, again."""
        out: list[str] = []
        memo = self.lines
        for line in text.split("\n"):
            hit = memo.get(line)
            if hit is None:
                if len(line) > _LINE_CHARS:
                    out += self.line_words(line)
                    continue
                if len(memo) >= _LINES_MAX:
                    memo.clear()
                hit = memo[line] = tuple(self.line_words(line))
            out += hit
        return out

    def line_words(self, text: str) -> list[str]:
        out: list[str] = []
        memo = self.chunks
        get = memo.get
        for chunk in text.split():
            hit = get(chunk)
            if hit is None:
                hit = self.chunk_words(chunk)
                if len(chunk) <= 64:  # bounded memory: at most 200k short chunks (URLs and the like are not kept)
                    if len(memo) >= _CHUNKS_MAX:
                        memo.clear()
                    memo[chunk] = hit
            out += hit
        return out

    def chunk_words(self, chunk: str) -> tuple[str, ...]:
        if has_no_space_script(chunk):
            return tuple(segment(chunk, self.language))
        if self.elision:
            m = _ELISION.match(chunk)
            if m:
                return (m.group(1), *self.chunk_words(chunk[m.end():]))
        return _chunk_tokens(chunk, self.exc)


_SPLITTERS: dict[str, _Splitter] = {}


def splitter(language: str | None) -> _Splitter:
    """The word split of `language` (None: English's rules)."""
    language = language or "en"
    if language not in _SPLITTERS:
        _SPLITTERS[language] = _Splitter(language)
    return _SPLITTERS[language]


_ENGLISH = splitter("en")
_CHUNKS, _LINES = _ENGLISH.chunks, _ENGLISH.lines


def tokenize_words(text: str, language: str | None = None) -> list[str]:
    """Words of `text` in `language` (None: English's rules, which every language shares but for the
    English exception table and the elisions; scripts without spaces are segmented in all)."""
    return (_ENGLISH if language is None or language == "en" else splitter(language)).words(text)


def _chunk_tokens(chunk: str, exc: dict[str, list[str]] = _EXC) -> tuple[str, ...]:
    in_exc = chunk in exc
    if _PLAIN.match(chunk):
        if not in_exc:
            return (chunk,)
    elif not in_exc:
        m = _WORD_PUNCT.match(chunk)
        if m:
            w, p = m.groups()
            # spaCy splits a final "." only after a lower-case letter or two upper-case ones
            if w not in exc and (p != "." or w[-1].islower() or (len(w) > 1 and w[-1].isupper()
                                                                and w[-2].isupper())):
                return (w, p)
    pieces: list[str] = []
    _split_chunk(chunk, pieces, exc)
    return tuple(pieces)


def _is_punct(tok: str) -> bool:
    return all(unicodedata.category(c).startswith("P") for c in tok)


class FastWordTokenizer(WordTokenizer):
    """datatrove `WordTokenizer` without spaCy for `language` (ISO 639-1 code, default English); pass it
    as a filter's `language`."""

    def __init__(self, language: str = "en"):
        super().__init__(language)

    def word_tokenize(self, text: str) -> list[str]:
        return tokenize_words(text, self.language)

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        """Sentence spans as spaCy's sentencizer draws them: a sentence ends after a run of
        sentence-final punctuation, at the next token that is not punctuation."""
        if not any(c in SENT_END for c in text):
            stripped = text.rstrip()
            return [(0, len(stripped))] if stripped else [(0, 0)]
        spans: list[tuple[int, int]] = []
        pos = start = 0
        seen_end = False
        last_end = 0
        for tok in tokenize_words(text, self.language):
            i = text.find(tok, pos)
            if i < 0:  # not a substring (never expected): keep the position
                continue
            pos = i + len(tok)
            if seen_end and not _is_punct(tok):
                spans.append((start, last_end))
                start, seen_end = i, False
            elif tok in SENT_END:
                seen_end = True
            last_end = pos
        if last_end > start or not spans:
            spans.append((start, last_end))
        return spans

    def sent_tokenize(self, text: str) -> list[str]:
        return [s for s in (text[a:b].strip() for a, b in self.span_tokenize(text)) if s]
