"""The programming language of a code file, and the per-extension thresholds that judge it.

The table (`datapipe/assets/code_languages.json`, written by tools/gen_code_languages.py) joins BigCode's
language → extensions mapping (from GitHub linguist) with the StarCoder per-extension filter table that
NeMo Curator ships. Language names are BigCode's, normalised (`python`, `c++`, `c-sharp`, `common-lisp`).

`detect(path, declared)` decides, first answer wins:
1. `declared`: the record's language field or the source's `language:` (any spelling of a table name:
   `C#`, `c-sharp`, `Common Lisp`; a name the table lacks counts for nothing);
2. the file name, when the table lists it whole (`Dockerfile`, `Makefile`);
3. the longest extension the table knows (`x.cmake.in` before `.in`), case-sensitive first (`.C` is C++),
   then lower-cased;
4. an interpreter on a `#!` first line (`#!/usr/bin/env python3` → python), for scripts without one.
No answer: `None` (the code filter rejects the file as `unknown_language`).
"""
from __future__ import annotations

import functools
import json
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from datatrove.pipeline.filters.base_filter import BaseFilter

from datapipe.kinds import licenses
from storage.config import ConfigError

TABLE = Path(__file__).resolve().parents[1] / "assets" / "code_languages.json"
# interpreter (basename, version digits stripped) → language, for `#!` lines (linguist's `interpreters` of
# the languages in the table that are run as scripts)
_INTERPRETERS = {"python": "python", "pypy": "python", "sh": "shell", "bash": "shell", "zsh": "shell", "ksh": "shell",
                 "dash": "shell", "ash": "shell", "node": "javascript", "nodejs": "javascript", "perl": "perl",
                 "ruby": "ruby", "php": "php", "lua": "lua", "tclsh": "tcl", "wish": "tcl", "Rscript": "r",
                 "awk": "awk", "gawk": "awk", "julia": "julia", "make": "makefile", "escript": "erlang",
                 "runhaskell": "haskell", "scala": "scala", "csh": "tcsh", "tcsh": "tcsh", "fish": "fish"}
_SHEBANG = re.compile(r"#![ \t]*(\S+)(?:[ \t]+(\S+))?")


@dataclass(frozen=True)
class Thresholds:
    """One row of the per-extension table (None: no such rule for these files)."""
    include: bool
    max_line_length: int | None
    mean_line_length: int | None
    min_alphanum: float | None
    min_alpha: float | None


@functools.lru_cache(maxsize=1)
def table() -> dict:
    with open(TABLE, encoding="utf-8") as f:
        data = json.load(f)
    by_ext, by_ext_lower, by_name, names = {}, {}, {}, {}
    for key, entry in data["languages"].items():
        names[key] = key
        names[entry["name"].lower()] = key
        names[entry["name"].lower().replace(" ", "-")] = key
        for ext in entry["extensions"]:
            by_ext.setdefault(ext, key)
            by_ext_lower.setdefault(ext.lower(), key)
        for fname in entry["filenames"]:
            by_name.setdefault(fname, key)
    rows = {(lang, ext): Thresholds(**row) for lang, exts in data["thresholds"].items() for ext, row in exts.items()}
    return {"by_ext": by_ext, "by_ext_lower": by_ext_lower, "by_name": by_name, "names": names, "rows": rows,
            "display": {k: e["name"] for k, e in data["languages"].items()},
            "max_dots": max(ext.count(".") for ext in by_ext) + 1}


def canonical(name: str) -> str | None:
    """The table's key for any spelling of a language name (`C#`, `c-sharp`, `Python`), or None."""
    low = name.strip().lower()
    names = table()["names"]
    return names.get(low) or names.get(low.replace(" ", "-")) or names.get(low.replace("_", "-"))


def check_name(name: str, key: str) -> str:
    """`canonical(name)`, or a ConfigError naming `key` (and the closest names) for a language the table lacks."""
    found = canonical(name)
    if found is None:
        import difflib

        close = difflib.get_close_matches(name.lower(), table()["names"], n=3, cutoff=0.6)
        hint = f" (closest: {', '.join(close)})" if close else ""
        raise ConfigError(f"key '{key}': unknown programming language {name!r}{hint}; the names are those of "
                          f"{TABLE.name} (BigCode's table: python, javascript, c++, c-sharp, shell, ...)")
    return found


def display_name(lang: str) -> str:
    """`c-sharp` → `C#`: the name BigCode's and NeMo's per-extension lookups take."""
    return table()["display"].get(lang, lang)


def extension(path: str) -> str:
    """The extension the per-extension table is keyed by: after the last dot of the file name, lower
    case; empty without a dot (`Dockerfile`)."""
    base = posixpath.basename(path.replace("\\", "/"))
    return base.rsplit(".", 1)[1].lower() if "." in base.lstrip(".") else ""


def from_path(path: str) -> str | None:
    base = posixpath.basename(path.replace("\\", "/"))
    t = table()
    if base in t["by_name"]:
        return t["by_name"][base]
    parts = base.split(".")
    for k in range(max(1, len(parts) - t["max_dots"]), len(parts)):  # longest suffix first
        suffix = ".".join(parts[k:])
        lang = t["by_ext"].get(suffix) or t["by_ext_lower"].get(suffix.lower())
        if lang:
            return lang
    return None


def from_shebang(text: str) -> str | None:
    if not text.startswith("#!"):
        return None
    m = _SHEBANG.match(text[:200])
    if not m:
        return None
    prog = posixpath.basename(m.group(1))
    if prog == "env" and m.group(2):
        prog = posixpath.basename(m.group(2))
    return _INTERPRETERS.get(prog.rstrip("0123456789.").rstrip("-") or prog)


def detect(path: str | None, text: str, declared: str | None = None) -> str | None:
    """The file's language (see the module doc): a declared name the table lacks counts for nothing, so the
    file's name and `#!` line still decide."""
    return (canonical(declared) if declared else None) or (from_path(path) if path else None) or from_shebang(text)


def thresholds(lang: str, path: str | None) -> Thresholds | None:
    """The per-extension row for (language, extension), or None when the table has no such row."""
    return table()["rows"].get((lang, extension(path or "")))


class IdentifyCodeLanguage(BaseFilter):
    """The first step of a code source's chain: `code_language` in each document's metadata (`detect`),
    then the source's `languages` allow-list. Rejects: `unknown_language` (no answer: `language_detail` says
    what was tried), `language_not_listed`. Counts `code_language:<name>` and
    `license:<name>` per document read."""

    name = "💻 programming language"

    def __init__(self, declared: str | None = None, allowed: list[str] | None = None, exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.declared = canonical(declared) if declared else None
        self.allowed = {canonical(n) for n in allowed} if allowed else None

    def filter(self, doc) -> bool | tuple[bool, str]:
        meta = doc.metadata
        for lic in licenses(meta):
            self.stat_update(f"license:{lic}")
        declared = meta.pop("declared_language", None) or self.declared
        lang = detect(meta.get("path") or doc.id, doc.text, declared)
        if lang is None:
            meta["language_detail"] = (f"declared {declared!r}, not in the language table; " if declared else "") + \
                "no known extension, file name or #! interpreter"
            return False, "unknown_language"
        meta["code_language"] = lang
        self.stat_update(f"code_language:{lang}")
        if self.allowed is not None and lang not in self.allowed:
            return False, "language_not_listed"
        return True
