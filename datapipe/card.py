"""The dataset card: README.md beside manifest.json, in the Hugging Face Hub's dataset-card form.

YAML metadata first (`pretty_name`, `license`, `language`, `multilinguality`, `task_categories`, `task_ids`,
`size_categories`, `tags`: what `huggingface_hub.DatasetCard` reads), then Markdown: the sources with their
kinds, languages, documents and tokens, what every filter dropped, dedup and decontamination, and the mix
phases. The card is written from the manifest alone (its `build_config` holds the `card:` section below),
so `datapipe build` and `datapipe mix` write it the same way, and one manifest always gives the same bytes.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

import yaml

from storage import atomic, fs
from storage.config import ConfigError
from storage.manifest import Manifest

CARD_NAME = "README.md"
# the Hub's size_categories, by the dataset's number of documents (training and held out)
SIZE_CATEGORIES = ((10**3, "n<1K"), (10**4, "1K<n<10K"), (10**5, "10K<n<100K"), (10**6, "100K<n<1M"),
                   (10**7, "1M<n<10M"), (10**8, "10M<n<100M"), (10**9, "100M<n<1B"), (10**10, "1B<n<10B"),
                   (10**11, "10B<n<100B"), (10**12, "100B<n<1T"))
TOP = 5  # languages per source in the sources table; reasons per filter in the filters table


@dataclass
class CardConfig:
    """The `card:` section of a build config: what the card says that the build cannot know."""
    license: str | None = None  # a Hub licence id (apache-2.0, cc-by-4.0, odc-by, ...); null: `other`, with a note
    pretty_name: str | None = None  # null: the output folder's name
    tags: list[str] = field(default_factory=list)  # after the card's own: smoltrain and the sources' kinds

    def validate(self) -> None:
        if self.license is not None and not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", self.license):
            raise ConfigError(f"key 'card.license': {self.license!r} is not a Hub licence id (lower case, "
                              "e.g. apache-2.0, mit, cc-by-4.0, odc-by, other)")
        if self.pretty_name is not None and not self.pretty_name.strip():
            raise ConfigError("key 'card.pretty_name': empty (null: the output folder's name)")
        for i, tag in enumerate(self.tags):
            if not tag.strip():
                raise ConfigError(f"key 'card.tags.{i}': empty tag")


def size_category(documents: int) -> str:
    return next((name for bound, name in SIZE_CATEGORIES if documents < bound), "n>1T")


def _by_prefix(stats: dict, prefix: str) -> dict[str, int]:
    return {k[len(prefix):]: v for k, v in stats.items() if k.startswith(prefix)}


def metadata(m: Manifest) -> dict:
    """The card's YAML metadata, in the Hub's keys."""
    card = m.build_config.get("card") or {}
    langs = m.languages()
    natural = [lang for lang in langs if lang != "code"]
    documents = sum(s.documents for s in [*m.sources.values(), *m.validation.values()])
    kinds = sorted({s.content for s in m.sources.values()}) + sorted({s.kind for s in m.sources.values()} - {"text"})
    meta: dict = {"pretty_name": pretty_name(m), "license": card.get("license") or "other"}
    if langs:
        meta["language"] = langs
    if natural:
        meta["multilinguality"] = "multilingual" if len(natural) > 1 else "monolingual"
    meta.update(task_categories=["text-generation"], task_ids=["language-modeling"],
                size_categories=[size_category(documents)],
                tags=list(dict.fromkeys(["smoltrain", *kinds, *card.get("tags", [])])))
    return meta


def pretty_name(m: Manifest) -> str:
    card = m.build_config.get("card") or {}
    return card.get("pretty_name") or posixpath.basename(str(m.build_config.get("output", "")).rstrip("/")) or "dataset"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(head: list[str], rows: list[list], numeric: range) -> list[str]:
    """A Markdown table; the `numeric` columns right-aligned."""
    align = ["---:" if i in numeric else "---" for i in range(len(head))]
    return [_row(head), _row(align), *(_row(r) for r in rows), ""]


def _top(counts: dict[str, int], top: int = TOP) -> str:
    items = sorted(((k, v) for k, v in counts.items() if v), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{k} {v:,}" for k, v in items[:top])
    return text + (f", {len(items) - top} more" if len(items) > top else "")


def _sources(m: Manifest) -> list[str]:
    head = ["source", "kind", "records", "languages (documents kept by the filters)", "read", "documents",
            "tokens", "held-out documents", "held-out tokens"]
    keys = ("read", "documents", "tokens", "validation_documents", "validation_tokens")
    rows, total = [], dict.fromkeys(keys, 0)
    for name, s in m.sources.items():
        st = {**s.stats, "documents": s.documents, "tokens": s.tokens}
        langs = _by_prefix(s.stats, "kept_code_language:" if s.content == "code" else "kept_language:")
        rows.append([name, s.content, s.kind, _top(langs)] + [f"{int(st.get(k, 0)):,}" for k in keys])
        for k in keys:
            total[k] += int(st.get(k, 0))
    rows.append(["**total**", "", "", ""] + [f"{total[k]:,}" for k in keys])
    return ["## Sources", "", *_table(head, rows, range(4, len(head)))]


def _filters(m: Manifest) -> list[str]:
    rows = []
    for name, s in m.sources.items():
        for key, n in s.stats.items():
            if key.startswith("dropped_") and ":" not in key:
                reasons = _by_prefix(s.stats, f"{key}:")
                rows.append([name, f"`{key[len('dropped_'):]}`", f"{n:,}", _top(reasons, 3)])
    return ["## Filters", "",
            "Documents dropped per source and step, in the order the steps ran: `read` (bad records), "
            "`normalize`, language ID, then the source's filter chain (`INDEX_TYPE`); `too_long` and "
            "`prompt_too_long` after tokenizing. Every dropped document is in `rejects/` with its reason.", "",
            *_table(["source", "step", "dropped", "top reasons"], rows, range(2, 3))]


def _dedup(m: Manifest) -> list[str]:
    keys = ("exact_duplicates", "near_duplicates", "decontaminated")
    rows = [[name] + [f"{int(s.stats.get(k, 0)):,}" for k in keys] for name, s in m.sources.items()]
    out = ["## Deduplication and decontamination", "",
           "Exact and MinHash near duplicates removed within and across sources (a duplicate is kept in the "
           "source listed first in the build config; clusters in `dedup/`), and documents sharing an n-gram "
           "with an eval task (decontaminated).", "",
           *_table(["source", "exact duplicates", "near duplicates", "decontaminated"], rows, range(1, 4))]
    by_task = m.build_stats.get("decontaminated_by_task") or {}
    if by_task:
        out += ["Decontaminated per eval task: " + ", ".join(f"{k} {v:,}" for k, v in by_task.items()) + ".", ""]
    return out


def _mix(m: Manifest) -> list[str]:
    names = list(m.sources)
    rows = [[ph.name, f"{ph.tokens:,}"] + [f"{ph.weights[n]:.6g}" if n in ph.weights else "" for n in names]
            for ph in m.mix]
    return ["## Mix", "",
            "Phases of the training mix, in order: length in tokens and the relative weight of each source "
            "(`datapipe mix` rewrites them).", "",
            *_table(["phase", "tokens", *names], rows, range(1, len(names) + 2))]


def card_text(m: Manifest) -> str:
    """The whole README.md."""
    meta = metadata(m)
    train_docs, tokens = sum(s.documents for s in m.sources.values()), m.total_tokens
    held = sum(s.documents for s in m.validation.values())
    tok, sw = m.tokenizer, m.software
    license_line = (f"Released under `{meta['license']}` (`card.license` of the build config); the terms of "
                    "each source's own data still apply to its documents." if meta["license"] != "other" else
                    "`license: other`: the build config sets no licence (`card.license`), so the licences and "
                    "terms of each source's own data apply to its documents.")
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, default_flow_style=False).rstrip(),
             "---", "", f"# {meta['pretty_name']}", "",
             f"Tokenized training data built by smoltrain's `datapipe build` (smoltrain {sw.get('smoltrain', '?')}, "
             f"datatrove {sw.get('datatrove', '?')}): {len(m.sources)} source(s), {train_docs:,} documents and "
             f"{tokens:,} tokens for training, {held:,} held out for validation. Shards are LZ4 "
             f"WebDataset tar files per source (format v{m.format_version}, listed with checksums in "
             f"`manifest.json`); tokenizer `tokenizer.json` ({tok.vocab_size:,} tokens, EOS id {tok.eos_id}, "
             f"{tok.dtype}, sha256 `{tok.sha256}`)."
             + (" Conversations were rendered with the chat template stored in the manifest." if m.chat_template
                else ""), "",
             *_sources(m), *_filters(m), *_dedup(m), *_mix(m),
             "## License", "", license_line, "",
             "## Use", "",
             "Train on it with `data.dataset: PATH` in a `train` config, or read it with "
             "`storage.dataset.Dataset.open(PATH)`. `datapipe report PATH` prints these counts with charts; "
             "`build_config.yaml` beside this card is the build's resolved config."]
    return "\n".join(lines) + "\n"


def write_card(dataset: str, m: Manifest) -> None:
    """(Re)write DATASET/README.md atomically."""
    atomic.write_bytes(fs.join(dataset, CARD_NAME), card_text(m).encode())
