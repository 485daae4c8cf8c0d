"""Per-language filter settings: the shipped data files, which settings judge a document, the merged
parameters of each filter, and language codes.

`datapipe/assets/languages/LANG.yaml` holds, per language, the parameters of the Gopher, C4 and FineWeb
filters that differ from the source's chain (stop words, thresholds) and `min_score`, the language score
from which a document counts as written in it. The files for fr, es, de, it, pt, zh and ja are derived
from FineWeb-2's `configs/{iso3}_{script}.yml` by tools/gen_language_settings.py (which says how); `en`
changes nothing (the chain's values are FineWeb's English ones); `default.yaml` is the fallback.

`route(language, script, score)` picks the settings a document is filtered with:
1. `en`: the chain as configured (English output is what it was before language ID);
2. a language with a file (or a `language_filters` section in the build config) detected with a score of
   at least its `min_score`: its settings;
3. otherwise, Han script: `zh`'s settings; Han with kana: `ja`'s;
4. otherwise `default`: the chain without Gopher's stop-word rule (which needs the language's stop
   words); no language is dropped for having no settings.
Parameters of filter i for a document: datatrove's defaults ← the settings' file ← the chain's `params`
← the build config's `language_filters.<key>.<filter type>` (each later one wins).
"""
from __future__ import annotations

import csv
import functools
import os
from pathlib import Path
from typing import Any

import yaml

from storage.config import ConfigError

SETTINGS_DIR = Path(__file__).parent / "assets" / "languages"
DEFAULT = "default"
_SCRIPT_LANG = {"Hani": "zh", "Jpan": "ja"}


@functools.lru_cache(maxsize=1)
def shipped() -> dict[str, dict[str, Any]]:
    """Language (or `default`) → {"min_score": float, "filters": {filter type: params}} from the data files."""
    out = {}
    for path in sorted(SETTINGS_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        out[path.stem] = {"min_score": float(data.get("min_score", 0.0)), "filters": data.get("filters") or {}}
    return out


def route(language: str | None, script: str | None, score: float, extra: tuple[str, ...] = ()) -> str:
    """The settings key (a language code, or `default`) that judges a document; `extra`: languages the
    build config gives settings of its own."""
    if not language or language == "en":
        return "en"
    files = shipped()
    if language in files and score >= files[language]["min_score"]:
        return language
    if language in extra:
        return language
    return _SCRIPT_LANG.get(script or "", DEFAULT)


def filter_params(key: str, ftype: str, params: dict[str, Any], overrides: dict[str, dict[str, dict[str, Any]]]
                  ) -> dict[str, Any]:
    """The constructor arguments of a `ftype` filter for documents judged by settings `key`."""
    base = dict(shipped().get(key, {}).get("filters", {}).get(ftype) or {})
    for k in ("top_n_grams", "dup_n_grams"):  # YAML lists → datatrove's tuples of pairs
        if k in base:
            base[k] = tuple(tuple(x) for x in base[k])
    return {**base, **params, **(overrides.get(key, {}).get(ftype) or {})}


def check_overrides(overrides: dict[str, dict[str, dict[str, Any]]], allowed: dict[str, set[str]]) -> None:
    """`language_filters` keys: a known language code (or `default`), a filter type, its parameters."""
    for lang, by_type in overrides.items():
        if lang != DEFAULT and lang != "en":
            check_code(lang, f"language_filters.{lang}")
            if canonical(lang) != lang:
                raise ConfigError(f"key 'language_filters.{lang}': write the language as {canonical(lang)!r}")
        for ftype, params in (by_type or {}).items():
            if ftype not in allowed:
                raise ConfigError(f"key 'language_filters.{lang}.{ftype}': not a filter type with per-language "
                                  f"settings (types: {', '.join(sorted(allowed))})")
            for k in params or {}:
                if k not in allowed[ftype]:
                    raise ConfigError(f"key 'language_filters.{lang}.{ftype}.{k}': unknown parameter for filter "
                                      f"{ftype!r} (known: {', '.join(sorted(allowed[ftype]))})")


@functools.lru_cache(maxsize=1)
def _iso_tables() -> tuple[dict[str, str], frozenset[str]]:
    """ISO 639-3 → 639-1 (cmn → zh, eng → en) and every code datatrove's language table knows (639-1,
    639-3 and 639-3_Script), from datatrove's `assets/tokenizer_assignment.csv` (FineWeb-2's table)."""
    from datatrove.utils._import_utils import ASSETS_PATH

    to1: dict[str, str] = {}
    known: set[str] = set()
    with open(os.path.join(ASSETS_PATH, "tokenizer_assignment.csv"), encoding="utf-8") as f:
        for row in csv.DictReader(f):
            c3, c1 = row["code_3"], row["code_1"]
            known.update(x for x in (c3, c1, f"{c3}_{row['script']}") if x)
            if c1 and row["default_code_1"] == "TRUE":  # the language the 639-1 code names (cmn for zh, not yue)
                to1[c3] = c1
    to1.setdefault("zho", "zh")  # the macrolanguage's own code
    return to1, frozenset(known)


def canonical(code: str) -> str:
    """ISO 639-1 for a language that has a 639-1 code (`eng` → `en`, `cmn` → `zh`), else the code."""
    code = code.strip().split("_")[0]
    return _iso_tables()[0].get(code, code)


def check_code(code: str, key: str) -> str:
    """`canonical(code)`, or a ConfigError naming `key` for a code datatrove's language table does not know."""
    if code not in _iso_tables()[1] and code.split("_")[0] not in _iso_tables()[1]:
        raise ConfigError(f"key '{key}': unknown language code {code!r} (expected ISO 639-1 like 'fr' or "
                          "639-3 like 'fra', as in datatrove's tokenizer_assignment.csv)")
    return canonical(code)
