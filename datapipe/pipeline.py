"""Assemble `datapipe build`: datatrove stages in order, the chosen executor, and the final manifest.

Stages (tasks):
- calibrate (one per `classifier` filter with `keep_top`, only then): its threshold from a sample of the
  source (`datapipe.quality.calibrate`);
- scan (one per input piece: a file, or a byte / row-group range of a large one): read, normalise,
  filter; record the kept positions, exact hashes (by hash partition) and MinHash signatures (and the
  verification sketches);
- exact (one per hash partition), buckets (one per band), verify (one per band, if
  `dedup.minhash.verify_threshold`: candidate pairs below it are dropped), clusters (cc-edges, then
  `cluster_rounds` large-star/small-star rounds, cc-finish and the priority keep, `cluster_parts` tasks
  each but cc-finish: `datapipe.dedup.clusters`; timed together as "clusters");
- tokenizer (1: copy one, or train on a bounded prefix of the kept documents);
- tokenize (one per piece): re-read the input, apply the scan and dedup decisions
  (`datapipe.decisions`), decontaminate, encode, and write the piece's own shards (`datapipe.shardout`);
- validation (one per source: the held-out split from the candidates the tokenize tasks set aside);
- manifest (1).
No stage writes a copy of the text: the work dir holds positions, hashes, signatures, sketches and ids.
Chat sources are rendered by their template when read (see `datapipe.sources`), so every stage after
that sees plain text; the tokenize stage adds their loss masks, and the manifest records the template.
A preference pair is one document (both sides' text) until the tokenize stage splits it into its two
sides, so dedup, decontamination and the validation split act on whole pairs (`datapipe.preference`).
An RL prompt is rendered up to the generation prompt when read and stored without EOS or mask, its answer
in the block metadata (`datapipe.prompts`).
Task ranks are positions in the global, priority-ordered list of input pieces, so outputs are identical
for any worker count. Each stage logs completions under `WORK/logs/<stage>`; a rerun skips finished tasks
(datatrove's `skip_completed`) and redoes the rest, giving the same bytes as an uninterrupted build.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from datatrove.pipeline.base import PipelineStep

from datapipe import buildstats, emptycheck, executors, slurm
from datapipe.buildstats import ManifestStep, dataset_config
from storage.chat import load_template, template_special_tokens
from datapipe.config import BuildConfig
from datapipe.decisions import FilterAndRecord, Select
from datapipe.decontaminate import Decontaminate, load_index
from datapipe.dedup.buckets import FastMinhashBuckets
from datapipe.dedup.clusters import CCEdges, CCFinish, CCStep, ClusterKeep
from datapipe.dedup.exact import ExactHasher, ExactResolve
from datapipe.dedup.minhash import FastMinhashSignature, minhash_config
from datapipe.dedup.verify import MinhashVerify
from datapipe.filters import check_specs
from datapipe.langid import load_model
from datapipe.langsettings import canonical
from datapipe.normalize import Normalize
from datapipe.quality.calibrate import Calibrate, calibration_jobs
from datapipe.rejects import RejectsWriter
from datapipe.shardout import ShardOut, WriteValidation, source_infos
from datapipe.inputs import check_fields, expand_sources
from datapipe.sources import SourceReader
from datapipe.steps import CountsDump, PerSourceFilters, PrepareTokenizer
from datapipe.tokenize import TokenizeStep, check_special_tokens, load_tokenizer
from storage import config as cfgmod
from storage import atomic
from storage.config import ConfigError
from storage.manifest import Manifest, read_manifest


@dataclass
class Stage:
    name: str
    pipeline: list
    tasks: int
    report_as: str | None = None  # its time is added to this name's in build_report.json
    local_workers: int | None = None  # at most this many processes with the local executor


@dataclass
class BuildResult:
    manifest: Manifest
    elapsed_s: dict[str, float] = field(default_factory=dict)


def _fingerprint(cfg: BuildConfig) -> str:
    return hashlib.sha256(cfgmod.dump(dataset_config(cfg)).encode()).hexdigest()


class Build:
    def __init__(self, cfg: BuildConfig, workers: int | None = None, fresh: bool = False):
        if not cfg.sources:
            raise ValueError("no sources configured (the CLI fills in the embedded demo corpus)")
        self.cfg = cfg
        self.workers = workers or cfg.executor.workers
        self.out = cfg.output.rstrip("/")
        self.work = (cfg.work_dir or os.path.join(self.out, "_work")).rstrip("/")
        self.rejects = os.path.join(self.out, "rejects")
        self.files = expand_sources(cfg.sources, cfg.max_task_bytes)
        self.srcmap = {s.name: s for s in cfg.sources}
        for i, s in enumerate(cfg.sources):
            default = {"code": "kinds.code.filters", "math": "kinds.math.filters"}.get(s.kind, "default_filters")
            check_specs(cfg.filters_for(s), f"sources.{i}.filters" if s.filters is not None else default)
        check_fields(self.files, self.srcmap)
        if cfg.langid.enabled and any(not s.language for s in cfg.sources):
            known = load_model(cfg.langid).languages  # a missing or unreadable model fails here, before any stage
            for i, s in enumerate(cfg.sources):
                for j, code in enumerate(s.languages or []):
                    if canonical(code) not in known and not s.language:
                        raise ConfigError(f"key 'sources.{i}.languages.{j}': the language model "
                                          f"{cfg.langid.model or 'lid.176.ftz'} never answers {code!r}")
        self.chat_template = load_template(cfg.chat_template) if cfg.chat_template else None
        if cfg.tokenizer.path and not os.path.isfile(cfg.tokenizer.path):
            try:  # a missing local file fails here, not in the tokenizer stage after the scan
                load_tokenizer(cfg.tokenizer.path)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"key 'tokenizer.path': {e}") from None
        if self.chat_template is not None and cfg.tokenizer.path and os.path.isfile(cfg.tokenizer.path):
            check_special_tokens(load_tokenizer(cfg.tokenizer.path), template_special_tokens(self.chat_template),
                                 f"key 'tokenizer.path' ({cfg.tokenizer.path})")
        if cfg.decontaminate.enabled:
            load_index(cfg.decontaminate)  # a bad task spec or file fails here, before any stage runs
        self._prepare_dirs(fresh)
        self._empty_after_scan: set[str] = set()

    def w(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    @property
    def kinds(self) -> dict[str, str]:
        return {s.name: s.kind for s in self.cfg.sources}

    def _redactors(self) -> dict:
        """Source → Redactor, for the sources that redact (their read rejects are redacted too)."""
        from datapipe.kinds.redact import Redactor

        out = {}
        for s in self.cfg.sources:
            r = self.cfg.redact_for(s)
            if r.enabled:
                out[s.name] = Redactor(r.secrets, r.emails, r.ip_addresses)
        return out

    def _prepare_dirs(self, fresh: bool) -> None:
        # an interrupted run's temporary files (storage.atomic's rule): removed and counted, never published
        for root in dict.fromkeys((self.out, self.work)):
            if os.path.isdir(root):
                atomic.sweep(root)
        fp = _fingerprint(self.cfg)
        marker = self.w("config.sha256")
        old = Path(marker).read_text().strip() if os.path.exists(marker) else None
        if old is not None and (fresh or old != fp):
            # another config (or --fresh): earlier intermediate results must not be reused
            shutil.rmtree(self.work)
            if os.path.isdir(self.rejects):
                shutil.rmtree(self.rejects)
        atomic.write_bytes(marker, fp.encode())

    def stages(self) -> list[Stage]:
        cfg, F = self.cfg, len(self.files)
        mh, parts = cfg.dedup.minhash, cfg.dedup.exact_parts

        def rej(name: str) -> RejectsWriter:
            return RejectsWriter(os.path.join(self.rejects, name))

        reader = SourceReader(self.files, self.srcmap, self.rejects, cfg.normalize.max_chars, cfg.normalize,
                              self.chat_template, cfg.kinds.code.fields, self._redactors())
        norm = Normalize(cfg.normalize, rej("normalize"), self.kinds)
        scan = [reader, norm,
                FilterAndRecord(PerSourceFilters(cfg, self.files, self.rejects, self.w("counts", "filters"),
                                                 self.work), self.work),
                CountsDump({"read": reader, "normalize": norm}, self.w("counts", "read")),
                ExactHasher(self.work, parts)]
        if mh.enabled:
            mcfg = minhash_config(mh)
            scan.append(FastMinhashSignature(self.w("minhash", "sigs"), mcfg, spacy_words=not mh.fast_signatures,
                                             sketch_folder=self.w("minhash", "sketches") if mh.verify_threshold
                                             else None))
        stages = [Stage("scan", scan, F)]
        jobs = calibration_jobs(cfg)
        if jobs:  # the keep_top classifiers' thresholds, one task per (source, filter), before the scan
            reread = [SourceReader(self.files, self.srcmap, None, cfg.normalize.max_chars, cfg.normalize,
                                   self.chat_template, cfg.kinds.code.fields), Normalize(cfg.normalize, kinds=self.kinds)]
            stages.insert(0, Stage("calibrate", [Calibrate(cfg, self.files, reread, self.work)], len(jobs)))
        if cfg.dedup.exact:
            stages.append(Stage("exact", [ExactResolve(self.work, F)], parts))
        near_dir = None
        if mh.enabled:
            near_dir = self.w("minhash", "remove")
            pairs = self.w("minhash", "verified" if mh.verify_threshold else "buckets")
            stages.append(Stage("buckets", [FastMinhashBuckets(self.w("minhash", "sigs"), self.w("minhash", "buckets"),
                                                               config=mcfg)], mh.bands))
            if mh.verify_threshold:  # candidate pairs below the threshold are dropped (datapipe.dedup.verify)
                stages.append(Stage("verify", [MinhashVerify(self.w("minhash", "buckets"), self.w("minhash", "sketches"),
                                                             pairs, mh.verify_threshold)], mh.bands))
            stages += self._cluster_stages(pairs, near_dir)
        tok_path = os.path.join(self.out, "tokenizer.json")
        stages.append(Stage("tokenizer", [PrepareTokenizer(cfg, tok_path, self._reread(near_dir), F)], 1))
        tok_steps = self._reread(near_dir, rej("exact_dup"), rej("near_dup"))
        if cfg.decontaminate.enabled:
            tok_steps.append(Decontaminate(cfg.decontaminate, self.w("counts", "decontaminate"),
                                           rej("decontaminate")))
        tok_steps.append(TokenizeStep(tok_path, cfg.tokenizer.eos_token, self.shard_out(),
                                      [f.source for f in self.files], cfg.tokenizer.batch_size,
                                      {s.name: s.chat for s in cfg.sources if s.is_templated}, self.rejects,
                                      self.kinds))
        stages.append(Stage("tokenize", tok_steps, F))
        return stages

    def _cluster_stages(self, pairs: str, near_dir: str) -> list[Stage]:
        """Connected components of the verified pairs in `cluster_rounds` large-star/small-star rounds of
        `cluster_parts` tasks each, then the priority keep (datapipe.dedup.clusters). On one machine the
        steps run in the driver, one task after another: each is a sort of the pairs, small next to a scan,
        and a process pool per step would cost more than the step."""
        cfg, F = self.cfg, len(self.files)
        mh, cc = cfg.dedup.minhash, self.w("minhash", "cc")
        parts, last = mh.cluster_parts, 2 * mh.cluster_rounds
        return ([Stage("cc-edges", [CCEdges(pairs, cc, F)], parts, "clusters", 1)]
                + [Stage(f"cc-{k}", [CCStep(cc, k, F)], parts, "clusters", 1) for k in range(1, last + 1)]
                + [Stage("cc-finish", [CCFinish(cc, last, F, parts)], 1, "clusters", 1),
                   Stage("clusters", [ClusterKeep(cc, near_dir, self.work, cfg.dedup.exact_parts if cfg.dedup.exact
                                                  else 0)], parts, "clusters", 1)])

    def _reread(self, near_dir: str | None, exact_writer=None, near_writer=None) -> list[PipelineStep]:
        """Reader + normaliser (no rejects: the scan stage wrote them) + the scan and dedup decisions."""
        cfg = self.cfg
        return [SourceReader(self.files, self.srcmap, None, cfg.normalize.max_chars, cfg.normalize,
                             self.chat_template, cfg.kinds.code.fields),
                Normalize(cfg.normalize, kinds=self.kinds),
                Select(self.work, cfg.dedup.exact_parts if cfg.dedup.exact else 0, near_dir, exact_writer, near_writer)]

    def shard_out(self) -> ShardOut:
        cfg = self.cfg
        return ShardOut(self.out, self.work, os.path.join(self.out, "tokenizer.json"), cfg.shards.block_tokens, cfg.shards.shard_blocks,
                        cfg.validation, {s.name: s.record_kind if s.is_preference or s.is_prompts else None
                                         for s in cfg.sources})

    def final_stages(self) -> list[Stage]:
        names = [s.name for s in self.cfg.sources]
        return [Stage("validation", [WriteValidation(self.shard_out(), names, self.ranks_of(), len(self.files))],
                      len(names)),
                Stage("manifest", [ManifestStep(self)], 1)]

    def ranks_of(self) -> dict[str, list[int]]:
        return {s.name: [r for r, f in enumerate(self.files) if f.source == s.name] for s in self.cfg.sources}

    def submit_slurm(self, dry_run: bool = False, progress: bool = True) -> list[str]:
        """Submit the stages as a Slurm job chain; with `executor.slurm.wait`, return once it has finished
        (and write build_report.json: a stage's time runs from the previous stage's end to its own, as the
        completion markers of their tasks say, so queue waits are included)."""
        stages = self.stages() + self.final_stages()
        start = time.time()
        scripts = slurm.submit(self.cfg.executor, stages, self.work, dry_run, progress)
        if not dry_run and self.cfg.executor.slurm.wait:
            elapsed: dict[str, float] = {}
            for st in stages:
                end = slurm.stage_end(self.w("logs", st.name), st.tasks)
                key = st.report_as or st.name
                elapsed[key] = elapsed.get(key, 0.0) + max(0.0, end - start)
                start = max(start, end)
            self._write_report(elapsed)
        return scripts

    def _write_report(self, elapsed: dict[str, float]) -> None:
        # elapsed times vary run to run, so they live beside the manifest, not in it
        atomic.write_bytes(os.path.join(self.out, "build_report.json"),
                           json.dumps({"elapsed_s": elapsed}, indent=1).encode())

    def check_empty(self, final: bool) -> list[str]:
        """After the scan (filters) or before the manifest (dedup, decontamination): sources left with no
        documents (datapipe.emptycheck). Raises EmptyResultError if the build cannot go on; returns warnings."""
        if not final:
            stats = self.source_stats(scan_only=True)
            warnings = emptycheck.check(self.cfg, {n: st.get("kept", 0) for n, st in stats.items()}, stats,
                                        "the filters")
            self._empty_after_scan = {n for n, st in stats.items() if not st.get("kept", 0)}
            return warnings
        stats, ranks_of = self.source_stats(), self.ranks_of()
        left = {}
        for s in self.cfg.sources:
            train, val = source_infos(self.work, s.name, ranks_of[s.name], s.record_kind)
            left[s.name] = train.documents + val.documents
        warnings = emptycheck.check(self.cfg, left, stats, "dedup and decontamination")
        # sources the scan check already reported are not reported again
        return [w for w in warnings if not any(w.startswith(f"source {n!r}:") for n in self._empty_after_scan)]

    def run(self, progress: bool = True) -> BuildResult:
        from tqdm import tqdm

        elapsed: dict[str, float] = {}
        stages = self.stages() + self.final_stages()
        bar = tqdm(total=len(stages), desc="datapipe build", unit="stage", disable=not progress)
        for st in stages:
            if st.name == "manifest":
                self._warn(self.check_empty(final=True))
            bar.set_postfix_str(f"{st.name} ({st.tasks} tasks)")
            t0 = time.perf_counter()
            executors.run_stage(self.cfg.executor, st.name, st.pipeline, st.tasks,
                                min(self.workers, st.local_workers or self.workers), self.w("logs", st.name),
                                progress=progress)
            key = st.report_as or st.name
            elapsed[key] = elapsed.get(key, 0.0) + time.perf_counter() - t0
            bar.update(1)
            if st.name == "scan":
                self._warn(self.check_empty(final=False))
        bar.close()
        self._write_report(elapsed)
        return BuildResult(read_manifest(self.out), elapsed)

    @staticmethod
    def log_warning(line: str) -> None:
        from loguru import logger

        logger.warning(line)

    @staticmethod
    def _warn(lines: list[str]) -> None:
        for line in lines:
            print(f"warning: {line}", file=sys.stderr, flush=True)

    def source_stats(self, scan_only: bool = False) -> dict[str, dict[str, int]]:
        return buildstats.source_stats(self, scan_only)

    def write_manifest(self) -> Manifest:
        return buildstats.write_manifest(self)
