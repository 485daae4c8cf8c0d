"""Dataset `manifest.json`: tokenizer, shards per source with checksums, held-out validation shards,
build stats, mix schedule; for conversation data (format 2) each source's kind and the chat template."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from storage import config as cfgmod
from storage import atomic, fs
from storage.config import ConfigError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2  # newest: 2 when any source holds conversations (blocks with loss masks); 1 otherwise
SUPPORTED_VERSIONS = (1, 2)
SOURCE_KINDS = ("text", "chat", "preference", "prompts")
MASKED_KINDS = ("chat", "preference")  # sources whose blocks carry loss masks (format 2)


MIN_LANGUAGE_SHARE = 0.01  # a card names a language holding this share of a source's kept documents

@dataclass
class TokenizerInfo:
    file: str
    sha256: str
    vocab_size: int
    eos_id: int
    dtype: str  # uint16 or uint32


@dataclass
class ShardInfo:
    path: str  # relative to the dataset root, e.g. "web/shard-000000.tar"
    sha256: str
    bytes: int
    blocks: int
    documents: int
    tokens: int
    block_tokens: list[int] = field(default_factory=list)  # tokens per block, in index order (may be absent)


@dataclass
class SourceInfo:
    shards: list[ShardInfo] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    stats: dict[str, int] = field(default_factory=dict)  # read, dropped per filter, duplicates, ...
    # text: pretraining documents ending in EOS; chat: conversations with loss masks; preference: pairs of
    # documents `ID#chosen`, `ID#rejected` (masks on the completion), both sides in one block; prompts: RL
    # prompts rendered up to the generation prompt (no EOS, no mask), answers in the blocks' `doc_meta`
    kind: str = "text"
    # the source's `kind` in the build config: web (prose), code or math; absent in old manifests: web
    content: str = "web"
    # per `classifier` filter of the source's chain (its label, e.g. "2_classifier"): models, thresholds in use
    # (keep_top: calibrated), a histogram of the scores per model (fixed bins over its score range), kept and
    # unscored counts (datapipe.quality.qfilter.quality_summary); absent in old manifests and without one
    quality: dict[str, Any] = field(default_factory=dict)


@dataclass
class Phase:
    """One stage of the data mix: relative weights per source over a length in tokens."""
    name: str
    weights: dict[str, float]
    tokens: int


@dataclass
class Manifest:
    tokenizer: TokenizerInfo
    sources: dict[str, SourceInfo]
    mix: list[Phase] = field(default_factory=list)
    format_version: int = 1  # see `needed_version`
    build_stats: dict[str, Any] = field(default_factory=dict)
    build_config: dict[str, Any] = field(default_factory=dict)
    software: dict[str, str] = field(default_factory=dict)
    # Held-out split per source (`validation/SOURCE/shard-*.tar`); never in the mix or the training
    # loader. Optional: manifests written before it existed load with none.
    validation: dict[str, SourceInfo] = field(default_factory=dict)
    # Jinja text of the chat template the conversations were rendered with (format 2; None without chat
    # sources), for generation and the HF export.
    chat_template: str | None = None

    def needed_version(self) -> int:
        """2 when any source (or held-out split) holds conversations or preference pairs, else 1."""
        return 2 if any(s.kind in MASKED_KINDS for s in [*self.sources.values(), *self.validation.values()]) else 1

    def validate(self) -> None:
        if self.format_version not in SUPPORTED_VERSIONS:
            raise ConfigError(f"format_version {self.format_version} is not supported (this reader knows "
                              f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        for name, src in [*self.sources.items(), *self.validation.items()]:
            if src.kind not in SOURCE_KINDS:
                raise ConfigError(f"key 'sources.{name}.kind': expected one of {', '.join(SOURCE_KINDS)}, "
                                  f"got {src.kind!r}")
        if self.format_version < self.needed_version():
            raise ConfigError(f"format_version {self.format_version}: chat and preference sources need format_version 2")
        validate_mix(self.mix, self.sources)
        unknown = sorted(set(self.validation) - set(self.sources))
        if unknown:
            raise ConfigError(f"key 'validation': unknown source {unknown[0]!r} "
                              f"(sources: {', '.join(self.sources)})")

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.sources.values())

    def languages(self) -> list[str]:
        """The ISO codes holding at least MIN_LANGUAGE_SHARE of some source's documents kept by the filters,
        most documents first, then `code` (the Hub's code for programming languages) if a source is code:
        the `language` of the dataset card and of the model cards of models trained on it."""
        kept: dict[str, int] = {}
        for s in self.sources.values():
            counts = {k[len("kept_language:"):]: v for k, v in s.stats.items() if k.startswith("kept_language:")}
            total = sum(counts.values())
            for lang, n in counts.items():
                if n > 0 and n >= MIN_LANGUAGE_SHARE * total:
                    kept[lang] = kept.get(lang, 0) + n
        out = sorted(kept, key=lambda lang: (-kept[lang], lang))
        return out + ["code"] if any(s.content == "code" for s in self.sources.values()) else out


def validate_mix(mix: list[Phase], sources: dict[str, Any] | list[str]) -> None:
    """Weights positive and finite, sources known, phase lengths positive, names unique."""
    known = set(sources)
    seen = set()
    for i, ph in enumerate(mix):
        where = f"key 'mix.{i}' (phase {ph.name!r})"
        if ph.name in seen:
            raise ConfigError(f"{where}: duplicate phase name")
        seen.add(ph.name)
        if ph.tokens <= 0:
            raise ConfigError(f"{where}: tokens must be > 0, got {ph.tokens}")
        if not ph.weights:
            raise ConfigError(f"{where}: needs at least one source weight")
        for src, w in ph.weights.items():
            if src not in known:
                raise ConfigError(f"{where}: unknown source {src!r} (sources: {', '.join(sorted(known))})")
            if not (w > 0 and math.isfinite(w)):
                raise ConfigError(f"{where}: weight of {src!r} must be > 0, got {w}")


def read_manifest(dataset: str) -> Manifest:
    url = fs.join(dataset, MANIFEST_NAME)
    try:
        data = json.loads(fs.read_bytes(url))
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: no manifest; is {dataset} a smoltrain dataset?") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{url}: not valid JSON: {e}") from None
    return cfgmod.from_dict(Manifest, data, where=url)


def write_manifest(dataset: str, manifest: Manifest) -> None:
    """Atomically (re)write the manifest; it is the last file of a dataset to appear."""
    manifest.validate()
    data = json.dumps(cfgmod.to_plain(manifest), indent=1, sort_keys=False).encode()
    atomic.write_bytes(fs.join(dataset, MANIFEST_NAME), data)
