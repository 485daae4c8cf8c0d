"""Typed config of the source kinds (`kinds:` in a build config): each kind's default filter chain, its
redaction, and for code the record fields that carry a file's path, language, repository and licence."""
from __future__ import annotations

from dataclasses import dataclass, field

from datapipe.filterspec import FilterSpec
from storage.config import ConfigError

KINDS = ("web", "code", "math")
# filters that rewrite a document's text: their rewrite could not be mapped back from a math source's masked text
REWRITING = ("c4", "c4_paragraph")
KIND_ONLY = {"code": "code", "math_density": "math"}  # filter type → the only kind it applies to


def math_filters() -> list[FilterSpec]:
    """FineWeb's chain without C4's line rules (which rewrite the text and drop lines with `{`), judged on the
    text with formulas masked."""
    return [FilterSpec("gopher_repetition"), FilterSpec("gopher_quality"), FilterSpec("fineweb")]


@dataclass
class RedactConfig:
    """What `datapipe.kinds.redact` replaces with placeholders."""
    secrets: bool = False  # API keys, tokens, private keys, passwords → <KEY>, <PASSWORD>
    emails: bool = False  # → <EMAIL>
    ip_addresses: bool = False  # public IPv4 → <IP_ADDRESS>

    @property
    def enabled(self) -> bool:
        return self.secrets or self.emails or self.ip_addresses


@dataclass
class CodeRedactConfig(RedactConfig):
    """A code source's redaction: everything on, as BigCode's pipeline for The Stack."""
    secrets: bool = True
    emails: bool = True
    ip_addresses: bool = True


@dataclass
class CodeFields:
    """Record fields of a JSONL / Parquet code source (null: not read). A `format: text` source has one file
    per document: its path is the file's, relative to the pattern's folder."""
    path: str | None = "path"  # the file's path in its repository: language from its extension or name
    language: str | None = "language"  # the language as the input names it (The Stack v2: language; v1: lang)
    repo: str | None = "repo_name"  # passed through to the shards' doc_meta
    license: str | None = "license"  # passed through (a string or a list), counted per source in the manifest


@dataclass
class CodeKind:
    filters: list[FilterSpec] = field(default_factory=lambda: [FilterSpec("code")])
    redact: CodeRedactConfig = field(default_factory=CodeRedactConfig)
    fields: CodeFields = field(default_factory=CodeFields)

    def validate(self) -> None:
        check_chain(self.filters, "code", "kinds.code.filters")


@dataclass
class MathKind:
    filters: list[FilterSpec] = field(default_factory=math_filters)
    redact: RedactConfig = field(default_factory=RedactConfig)

    def validate(self) -> None:
        check_chain(self.filters, "math", "kinds.math.filters")


@dataclass
class KindsConfig:
    """Defaults of the sources of each kind (web's filter chain is the build's `default_filters`)."""
    code: CodeKind = field(default_factory=CodeKind)
    math: MathKind = field(default_factory=MathKind)


def check_chain(specs: list[FilterSpec], kind: str, key: str) -> None:
    for i, spec in enumerate(specs):
        only = KIND_ONLY.get(spec.type)
        if only is not None and only != kind:
            raise ConfigError(f"key '{key}.{i}': filter {spec.type!r} applies to kind {only!r} sources only "
                              f"(this chain is for kind {kind!r})")
        if kind == "math" and spec.type in REWRITING:
            raise ConfigError(f"key '{key}.{i}': filter {spec.type!r} rewrites lines, which cannot be mapped back "
                              "from a math source's masked text (formulas hidden from the prose rules); use "
                              "gopher_*, fineweb, language, fasttext, classifier or math_density")
        if kind == "code" and spec.type not in ("code", "fasttext", "classifier"):
            raise ConfigError(f"key '{key}.{i}': filter {spec.type!r} judges prose; code sources take code "
                              "(The Stack's rules), fasttext or classifier (a model trained on code)")

