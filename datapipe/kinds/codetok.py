"""Tokens of code for dedup: comments dropped, layout ignored, and identifiers also seen by their pattern of use.

`tokens(text, language)`: strings, identifiers, numbers and single operator characters, in order, with the
comments of the language's family removed (`#`, `//` and `/* */`, `--`, `;`, `%`, `<!-- -->`; unknown
languages keep everything). Two copies of a file that differ in layout or comments give the same tokens.

`shingles(tokens, n)` → the hashed n-grams (64-bit, seeded apart from prose shingles) of the tokens
with each identifier after its first occurrence replaced by the distance (in tokens) to its previous one
(Baker's parameterized strings, the classic of clone detection, keeping the first occurrence's name so
that files of equal shape and other names stay apart). A consistently renamed identifier changes only the
n-grams around its first occurrence, where raw tokens lose every n-gram near any of its uses (recall on
renamed, reformatted and re-commented copies: docs/benchmarks.md, tools/bench/bench_code.py).
`exact_key(text)`: the text with whitespace runs collapsed, the exact-dedup key of code (reindented or
re-wrapped copies are one).
"""
from __future__ import annotations

import re

import numpy as np
import xxhash

_STRING = r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\''
_TOKEN = re.compile(_STRING + r"|[^\W\d]\w*|\d[\w.]*|[^\s\w]")
_COMMENTS = {
    "hash": r"#[^\n]*",
    "slash": r"//[^\n]*|/\*[\s\S]*?\*/",
    "dash": r"--[^\n]*|\{-[\s\S]*?-\}",
    "semicolon": r";[^\n]*",
    "percent": r"%[^\n]*",
    "markup": r"<!--[\s\S]*?-->",
}
FAMILY = {
    **dict.fromkeys(("python", "shell", "ruby", "perl", "r", "yaml", "toml", "makefile", "cmake", "dockerfile", "tcl",
                     "awk", "powershell", "julia", "elixir", "coffeescript", "nimrod", "crystal", "perl6", "nix",
                     "gdscript", "cython", "tcsh", "fish", "gentoo-ebuild", "sage", "starlark", "hcl"), "hash"),
    **dict.fromkeys(("c", "c++", "c-sharp", "java", "javascript", "typescript", "go", "rust", "kotlin", "scala",
                     "swift", "dart", "php", "objective-c++", "groovy", "css", "less", "scss", "protocol-buffer",
                     "solidity", "zig", "cuda", "glsl", "verilog", "systemverilog", "jsx", "d", "haxe", "actionscript",
                     "thrift", "json5", "opencl", "hlsl", "metal", "processing", "arduino", "vala", "ceylon",
                     "apex", "chapel", "pawn", "sqf", "stan", "webidl", "graphql"), "slash"),
    **dict.fromkeys(("sql", "lua", "haskell", "ada", "elm", "vhdl", "agda", "idris", "purescript", "applescript",
                     "eiffel"), "dash"),
    **dict.fromkeys(("common-lisp", "emacs-lisp", "scheme", "clojure", "racket", "assembly", "ini", "lfe", "hy",
                     "autohotkey", "nasm"), "semicolon"),
    **dict.fromkeys(("tex", "matlab", "erlang", "prolog", "postscript", "mathematica", "octave"), "percent"),
    **dict.fromkeys(("html", "xml", "svg", "vue", "markdown", "xslt"), "markup"),
}
_MARKERS = {"hash": ("#",), "slash": ("//", "/*"), "dash": ("--", "{-"), "semicolon": (";",), "percent": ("%",),
            "markup": ("<!--",)}
_LEXERS: dict[str, re.Pattern] = {}
_SEED = 0xC0DE  # shingle hashes of code never meet a prose shingle's by design of the mixing below
_WS = re.compile(r"\s+")
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def tokens(text: str, language: str | None) -> list[str]:
    """Strings, identifiers, numbers and operator characters in order, the language family's comments out."""
    family = FAMILY.get(language or "")
    if family is None:
        return _TOKEN.findall(text)
    if family not in _LEXERS:  # comments match first, as whole tokens, then dropped by their opening marker
        _LEXERS[family] = re.compile(f"{_COMMENTS[family]}|{_TOKEN.pattern}")
    markers = _MARKERS[family]
    return [t for t in _LEXERS[family].findall(text) if not t.startswith(markers)]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def shingles(toks: list[str], n: int) -> np.ndarray:
    """The distinct hashed n-grams of the parameterized token stream, as a (k, 1) uint64 array (in numpy:
    tokens hashed once per distinct token, previous occurrences found by a sort, n-grams combined as
    polynomials of their tokens' hashes and mixed)."""
    if len(toks) < n:
        return np.zeros((0, 1), dtype=np.uint64)
    vocab: dict[str, int] = {}
    codes = np.fromiter((vocab.setdefault(t, len(vocab)) for t in toks), dtype=np.int64, count=len(toks))
    words = list(vocab)
    tok_hash = np.fromiter((xxhash.xxh64_intdigest(w.encode("utf-8", "surrogatepass"), _SEED) for w in words),
                           dtype=np.uint64, count=len(words))
    is_ident = np.fromiter((w[0].isalpha() or w[0] == "_" for w in words), dtype=bool, count=len(words))
    pos = np.arange(len(toks))
    order = np.lexsort((pos, codes))  # by token, then position
    same = codes[order[1:]] == codes[order[:-1]]
    prev = np.full(len(toks), -1)
    prev[order[1:][same]] = order[:-1][same]
    repeat = is_ident[codes] & (prev >= 0)
    # an identifier seen before: the distance to its previous occurrence, hashed apart from token hashes
    values = np.where(repeat, _mix((pos - prev).astype(np.uint64) + np.uint64(_SEED << 32)), tok_hash[codes])
    with np.errstate(over="ignore"):
        grams = values[:len(toks) - n + 1].copy()
        for j in range(1, n):
            grams = grams * np.uint64(0x100000001B3) + values[j:len(toks) - n + 1 + j]
    return np.unique(_mix(grams)).reshape(-1, 1)


def exact_key(text: str) -> str:
    return _WS.sub(" ", text).strip()
