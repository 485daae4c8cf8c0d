"""`datapipe plan`: predict a build's wall time, CPU-hours, scratch and output bytes before running it.

It measures instead of guessing: a sample of the real input (the first records of input files spread over
each source, `sample_mb` in all, split between sources by their input bytes) is built for real, with the
same config, in one worker (BPE encoding single-threaded, as in the build's workers); each stage's time is
then scaled to the whole corpus by what it grows with:

- per-piece stages (scan, tokenize): seconds per input byte × corpus bytes, run as waves of
  min(pieces, cpus) tasks (a wave lasts as long as its largest piece);
- exact (`exact_parts` tasks), buckets and verify (`bands` tasks), clusters (`cluster_parts` tasks; one
  process on the local executor) and validation: linear in the corpus,
  spread over their task count;
- tokenizer: linear in the documents it trains on, at most `tokenizer.train_max_docs`; calibrate (keep_top
  classifiers) likewise, at most their `calibration_docs`;
- manifest: constant.
Scratch (the work dir without logs) and output bytes (but the tokenizer file) scale with the input bytes. Compressed inputs are
counted at their decompressed size, estimated from the sample. The sample takes records from 8 windows
spread over each sampled file (compressed files: their first records), so a file sorted by topic or
length is not judged by its head.
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import fsspec

from datapipe.config import BuildConfig
from datapipe.hfdata import COLUMNAR, record_batches
from datapipe.inputs import InputFile, open_binary, expand_sources

PER_PIECE = ("scan", "tokenize")


@dataclass
class Plan:
    input_bytes: int
    pieces: int
    cpus: int
    sample_bytes: int
    stage_s: dict[str, float] = field(default_factory=dict)  # predicted wall seconds per stage
    cpu_s: float = 0.0
    scratch_bytes: int = 0
    output_bytes: int = 0

    @property
    def wall_s(self) -> float:
        return sum(self.stage_s.values())


def _file_bytes(files: list[InputFile]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in files:
        for url, _ in f.members:
            if url not in out:
                out[url] = fsspec.open(url).fs.size(url)
    return out


def _piece_bytes(f: InputFile, size: int, pieces_of_file: int, sizes: dict[str, int]) -> int:
    if f.more:  # a group of text files
        return sum(sizes[u] for u, _ in f.members)
    if f.end is not None and f.fmt != "parquet":
        return f.end - f.start
    if f.start and f.fmt != "parquet":
        return size - f.start
    return size // pieces_of_file


def _sample_text(files: list[InputFile], want: int, out_path: str, text_field: str, path_field: str | None) -> int:
    """Whole files of a `format: text` source, evenly spread, as JSONL records (with their path when the
    source is code); returns raw bytes read."""
    members = [m for f in files for m in f.members]
    raw, step = 0, max(1, len(members) // 64)
    with open(out_path, "wb") as out:
        for url, rel in members[::step] + members[1::step]:
            with open_binary(url) as fh:
                data = fh.read()
            rec = {text_field: data.decode("utf-8", "replace"), **({path_field: rel} if path_field else {})}
            out.write(json.dumps(rec, ensure_ascii=False).encode() + b"\n")
            raw += len(data)
            if raw >= want:
                break
    return raw


def _sample_source(files: list[InputFile], want: int, out_path: str, text_field: str, id_field: str | None) -> int:
    """Writes the first records of evenly spread files of one source as JSONL; returns raw bytes read."""
    urls = list(dict.fromkeys(f.url for f in files))
    picks = [urls[round(i * (len(urls) - 1) / max(1, min(8, len(urls)) - 1))] for i in range(min(8, len(urls)))]
    per_file = want // len(picks) + 1
    raw = 0
    fmt_of = {f.url: f.fmt for f in files}
    with open(out_path, "wb") as out:
        for url in dict.fromkeys(picks):
            got, fmt = 0, fmt_of[url]
            if fmt in COLUMNAR:
                for batch in record_batches(url, fmt, [c for c in (text_field, id_field) if c], batch_size=256):
                    for rec in batch.to_pylist():
                        line = json.dumps(rec, ensure_ascii=False).encode() + b"\n"
                        out.write(line)
                        got += len(line)
                    if got >= per_file:
                        break
            elif url.lower().endswith((".gz", ".zst", ".zstd")):  # not seekable: its first records
                with open_binary(url) as fh:
                    for line in fh:
                        out.write(line if line.endswith(b"\n") else line + b"\n")
                        got += len(line)
                        if got >= per_file:
                            break
            else:  # records from 8 windows spread over the file
                with fsspec.open(url, "rb") as fh:
                    size = fh.size
                    for k in range(8):
                        fh.seek(size * k // 8)
                        if k:
                            fh.readline()  # the rest of a record cut by the seek
                        taken = 0
                        while taken < per_file // 8 + 1:
                            line = fh.readline()
                            if not line:
                                break
                            out.write(line if line.endswith(b"\n") else line + b"\n")
                            taken += len(line)
                        got += taken
            raw += got
    return raw


def _dir_bytes(path: str, skip: str = "logs") -> int:
    total = 0
    for dirpath, dirs, names in os.walk(path):
        if skip in dirs:
            dirs.remove(skip)
        total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
    return total


def make_plan(cfg: BuildConfig, nodes: int, cpus_per_node: int, sample_mb: float = 32.0,
              tmp: str | None = None, progress: bool = False) -> Plan:
    from datapipe.pipeline import Build

    files = expand_sources(cfg.sources, cfg.max_task_bytes)
    sizes = _file_bytes(files)
    per_file: dict[str, int] = {}
    for f in files:
        per_file[f.url] = per_file.get(f.url, 0) + 1
    cpus = nodes * cpus_per_node
    root = tempfile.mkdtemp(prefix="datapipe-plan-", dir=tmp)
    try:
        scfg = copy.deepcopy(cfg)
        scfg.output, scfg.work_dir = os.path.join(root, "out"), None
        scfg.executor.kind = "local"
        src_bytes = {s.name: sum(sizes[u] for u in {u for f in files if f.source == s.name for u, _ in f.members})
                     for s in cfg.sources}
        total_src = sum(src_bytes.values()) or 1
        raw_sample = 0
        for s in scfg.sources:
            mine = [f for f in files if f.source == s.name]
            want = int(sample_mb * 1e6 * src_bytes[s.name] / total_src) + 1
            path = os.path.join(root, f"sample-{s.name}.jsonl")
            if mine[0].fmt == "text":
                raw_sample += _sample_text(mine, want, path, s.text_field,
                                           scfg.kinds.code.fields.path if s.kind == "code" else None)
            else:
                raw_sample += _sample_source(mine, want, path, s.text_field, s.id_field)
            s.paths = [path]
            if not s.is_templated:  # auto, parquet, arrow, save_to_disk, hub_parquet, text
                s.format, s.subset = "jsonl", None
        build = Build(scfg, workers=1, fresh=True)
        old = os.environ.get("TOKENIZERS_PARALLELISM")
        if cpus > 1:  # timed as the build's workers run: one process per CPU, BPE encoding single-threaded
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            res = build.run(progress=progress)
        finally:
            if old is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = old
        scale_docs = _decompressed_total(files, sizes)
        ratio = scale_docs / max(1, raw_sample)
        plan = Plan(input_bytes=scale_docs, pieces=len(files), cpus=cpus, sample_bytes=raw_sample)
        docs_sample = res.manifest.build_stats.get("read", 0)
        for name, secs in res.elapsed_s.items():
            if name in PER_PIECE:
                total = secs * ratio
                biggest = max(_piece_bytes(f, sizes[f.url], per_file[f.url], sizes) for f in files)
                waves = math.ceil(len(files) / cpus)
                wall = max(total / min(cpus, len(files)), waves * secs * biggest / max(1, raw_sample))
            elif name == "tokenizer":
                total = wall = secs * min(ratio, max(1.0, cfg.tokenizer.train_max_docs / max(1, docs_sample)))
            elif name == "calibrate":
                most = max(spec.params.get("calibration_docs", 10_000) for s in cfg.sources
                           for spec in cfg.filters_for(s) if spec.type == "classifier")
                total = wall = secs * min(ratio, max(1.0, most / max(1, docs_sample)))
            elif name == "manifest":
                total = wall = secs
            else:
                tasks = {"exact": cfg.dedup.exact_parts, "buckets": cfg.dedup.minhash.bands,
                         "verify": cfg.dedup.minhash.bands, "clusters": 1 if cfg.executor.kind == "local" else cfg.dedup.minhash.cluster_parts,
                         "validation": len(cfg.sources)}.get(name, 1)
                total = secs * ratio
                wall = total / min(cpus, tasks)
            plan.stage_s[name] = wall
            plan.cpu_s += total
        plan.scratch_bytes = int(_dir_bytes(build.work) * ratio)
        fixed = os.path.getsize(os.path.join(scfg.output, "tokenizer.json"))  # one copy, whatever the size
        shards = _dir_bytes(scfg.output, skip="_work") - _dir_bytes(os.path.join(scfg.output, "rejects")) - fixed
        plan.output_bytes = int(shards * ratio) + fixed
        return plan
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _decompressed_total(files: list[InputFile], sizes: dict[str, int]) -> int:
    """Input bytes as the reader sees them: compressed files scaled by the ratio measured on their start."""
    total = 0
    for url in dict.fromkeys(u for f in files for u, _ in f.members):
        size = sizes[url]
        if url.lower().endswith((".gz", ".zst", ".zstd")):
            with fsspec.open(url, "rb") as fh:
                head = fh.read(1 << 20)
            with open_binary(url) as fh:
                plain = fh.read(8 << 20)
            size = int(size * len(plain) / max(1, len(head))) if len(head) >= 1 << 20 else len(plain)
        total += size
    return total


def format_plan(p: Plan, nodes: int, cpus_per_node: int) -> list[str]:
    gb = 1e9
    lines = [f"input {p.input_bytes / gb:,.2f} GB in {p.pieces:,} tasks per stage; {nodes} node(s) x "
             f"{cpus_per_node} CPUs; measured on a {p.sample_bytes / 1e6:,.1f} MB sample",
             f"{'stage':<12}{'predicted wall':>16}"]
    lines += [f"{name:<12}{_hms(s):>16}" for name, s in p.stage_s.items()]
    lines += [f"{'total':<12}{_hms(p.wall_s):>16}",
              f"CPU-hours {p.cpu_s / 3600:,.2f}; scratch (work dir) {p.scratch_bytes / gb:,.2f} GB "
              f"({p.scratch_bytes / max(1, p.input_bytes):.2f}x input); output {p.output_bytes / gb:,.2f} GB"]
    return lines


def _hms(s: float) -> str:
    h, rem = divmod(int(round(s)), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"
