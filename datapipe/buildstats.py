"""What a finished build reports: the counts per source gathered from the tasks' files, the manifest (with
the dedup reports and the dataset card beside it), the manifest stage, and `datapipe mix`'s rewrite of a
dataset's mix (and card)."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
from datatrove.pipeline.base import PipelineStep

from datapipe.card import write_card
from datapipe.decisions import kept_path
from datapipe.dedup.clusters import near_removals
from datapipe.dedup.clusters import write_report as write_near_report
from datapipe.dedup.exact import exact_removals, write_report
from datapipe.shardout import source_infos, task_info_path
from datapipe.steps import COUNT_PREFIXES
from datapipe.tokenize import tokenizer_info
from datapipe.workfiles import load_npy, read_json
from storage import config as cfgmod
from storage.manifest import Manifest, SourceInfo, read_manifest
from storage.manifest import write_manifest as store_manifest


def dataset_config(cfg) -> dict:
    """The config as the dataset records it: all but `executor`, which changes how a build runs, not its bytes
    (so a build resumes on another executor, and every executor writes the same manifest)."""
    plain = cfgmod.to_plain(cfg)
    del plain["executor"]
    return plain


def source_stats(build, scan_only: bool = False) -> dict[str, dict[str, int]]:
    """Counts per source: read, dropped per filter, languages; unless `scan_only`, dedup too."""
    out: dict[str, dict[str, int]] = {}

    def add(st: dict[str, int], k: str, v: int) -> None:
        st[k] = st.get(k, 0) + int(v)

    for r, f in enumerate(build.files):
        st = out.setdefault(f.source, {})
        read = read_json(build.w("counts", "read", f"{r:05d}.json"))
        add(st, "read", read["read"].get("read", 0))
        add(st, "dropped_read", read["read"].get("dropped_read", 0))
        for k, v in read["read"].items():
            if k.startswith("dropped_read:"):  # a chat source's rejected conversations, per reason
                add(st, k, v)
        add(st, "dropped_normalize", read["normalize"].get("dropped", 0))
        for k, v in read_json(build.w("counts", "filters", f"{r:05d}.json")).items():
            add(st, k if k.startswith(COUNT_PREFIXES) else f"dropped_{k}", v)
        if scan_only:
            add(st, "kept", len(load_npy(kept_path(build.work, r), np.uint32)))
            continue
        parts = build.cfg.dedup.exact_parts if build.cfg.dedup.exact else 0
        add(st, "exact_duplicates", len(exact_removals(build.w("exact"), r, parts)))
        add(st, "near_duplicates", len(near_removals(build.w("minhash", "remove"), r)))
        add(st, "decontaminated", _decont_counts(build, r).get("decontaminated", 0))
        if build.srcmap[f.source].is_templated:
            counts = read_json(task_info_path(build.work, r)).get("counts", {})
            keys = {"preference": ("dropped_too_long", "truncated", "loss_tokens", "dropped_prompt_too_long"),
                    "prompts": ("dropped_too_long", "with_answer")}.get(
                build.srcmap[f.source].record_kind, ("dropped_too_long", "truncated", "loss_tokens"))
            for k in keys:
                add(st, k, counts.get(k, 0))
    return out


def _quality(build, src, stats: dict[str, int]) -> dict:
    """The manifest's `quality` of a source: one entry per classifier filter (its counts leave `stats`)."""
    from datapipe.filters import filter_label
    from datapipe.workfiles import calibration_path
    from datapipe.quality.qfilter import quality_summary

    out = {}
    for i, spec in enumerate(build.cfg.filters_for(src)):
        if spec.type == "classifier":
            label = filter_label(spec, i)
            out[label] = quality_summary(spec.params, label, stats, calibration_path(build.work, src.name, i))
    return out


def _decont_counts(build, rank: int) -> dict:
    path = build.w("counts", "decontaminate", f"{rank:05d}.json")
    return read_json(path) if os.path.exists(path) else {}


def decontaminated_by_task(build) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in range(len(build.files)):
        for task, n in _decont_counts(build, r).get("by_task", {}).items():
            out[task] = out.get(task, 0) + n
    return dict(sorted(out.items()))


def write_manifest(build) -> Manifest:
    import tokenizers

    tinfo = tokenizer_info(os.path.join(build.out, "tokenizer.json"), build.cfg.tokenizer.eos_token)
    stats = source_stats(build)
    sources: dict[str, SourceInfo] = {}
    validation: dict[str, SourceInfo] = {}
    ranks_of = build.ranks_of()
    for s in build.cfg.sources:
        info, val = source_infos(build.work, s.name, ranks_of[s.name], s.record_kind)
        info.stats = {**stats.get(s.name, {}), "documents": info.documents, "tokens": info.tokens,
                      "validation_documents": val.documents, "validation_tokens": val.tokens}
        info.quality = _quality(build, s, info.stats)
        info.kind = val.kind = s.record_kind
        info.content = val.content = s.kind
        if s.is_preference:  # documents are sides: two per pair
            info.stats.update(pairs=info.documents // 2, validation_pairs=val.documents // 2)
        sources[s.name] = info
        if val.documents:
            validation[s.name] = val
    mix = build.cfg.mix.resolve({n: i.tokens for n, i in sources.items()})
    totals: dict[str, Any] = {}
    for info in sources.values():
        for k, v in info.stats.items():
            totals[k] = totals.get(k, 0) + v
    if build.cfg.decontaminate.enabled:
        totals["decontaminated_by_task"] = decontaminated_by_task(build)
    m = Manifest(tokenizer=tinfo, sources=sources, mix=mix, build_stats=totals, validation=validation,
                 build_config=dataset_config(build.cfg), chat_template=build.chat_template,
                 software={"smoltrain": _pkg_version("smoltrain"), "datatrove": _pkg_version("datatrove"),
                           "tokenizers": tokenizers.__version__})
    m.format_version = m.needed_version()
    if build.cfg.dedup.exact:
        write_report(build.work, build.cfg.dedup.exact_parts, os.path.join(build.out, "dedup", "exact_clusters.jsonl"))
    if build.cfg.dedup.minhash.enabled:
        write_near_report(build.w("minhash", "cc"), build.cfg.dedup.minhash.cluster_parts,
                          os.path.join(build.out, "dedup", "near_dup_clusters.jsonl"))
    cfgmod.save(dataset_config(build.cfg), os.path.join(build.out, "build_config.yaml"))
    m.validate()  # before the card that describes it; the manifest is still the last file to appear
    write_card(build.out, m)
    store_manifest(build.out, m)
    return m


class ManifestStep(PipelineStep):
    """Last stage: gathers per-task counts and per-source shard lists into manifest.json."""

    name = "🧾 manifest"

    def __init__(self, build):
        super().__init__()
        self.build = build

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        if self.build.cfg.executor.kind != "local":  # Slurm and Ray: the driver did not check
            for line in self.build.check_empty(final=True):
                self.build.log_warning(line)
        write_manifest(self.build)


def _pkg_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def rewrite_mix(dataset: str, mix_cfg) -> Manifest:
    """`datapipe mix`: replace the mix schedule of an existing dataset (validated), nothing else."""
    m = read_manifest(dataset)
    m.mix = mix_cfg.resolve({n: s.tokens for n, s in m.sources.items()})
    for i, ph in enumerate(m.mix):
        for n, w in ph.weights.items():
            if w > 0 and n in m.sources and m.sources[n].tokens == 0:
                raise cfgmod.ConfigError(f"key 'mix.phases.{i}.weights.{n}': source {n!r} has no documents in "
                                         f"{dataset} (see `datapipe report {dataset}`)")
    m.validate()
    write_card(dataset, m)
    store_manifest(dataset, m)
    return m
