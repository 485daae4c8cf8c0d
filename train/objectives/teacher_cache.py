"""Precomputed teacher top-k logits for distillation (`distill.precomputed: true`, with `distill.top_k`),
for a teacher too large to share the GPUs with the student and its optimizer.

One pass runs the teacher alone (`train teacher-cache CONFIG`, or `train launch` before training when the
cache is missing: Distill.run_pass in processes without the student) over exactly the rows the run will
read: its loader (same dataset, mix, seed, sequence length) for its `steps` steps, in any TP × PP × DP
layout. For every row it keeps the teacher's k largest logits
(float32) and their token ids per position, keyed by the row's content (XXH3-128 of its tokens): the
teacher's outputs for a row depend on nothing else, so the training run finds its rows under any layout.

Stored beside the dataset as DATASET/teacher/<fingerprint>/ (RUN_DIR/teacher/ with synthetic data): one
part per DP rank of the pass (`dpNNNNN.keys|.values|.ids` and a JSON with their sha256) and `cache.json`
last, naming the parts. The fingerprint covers the dataset's fingerprint, the teacher checkpoint's hash,
k, and what decides the rows (the data section, seed, steps, batch sizes, objective), so another teacher,
dataset or data order gets its own folder, never a stale one; loading checks every part's checksum.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import torch
import xxhash
from storage.fs import file_sha256


class TeacherCacheError(RuntimeError):
    """A cache that is missing, corrupt, or does not hold a row the run reads; the message says which."""


def fingerprint(cfg, teacher_ckpt: str) -> str:
    from train.objectives.refs import checkpoint_hash

    if cfg.debug.synthetic_data or not cfg.data.dataset:
        data_fp = "synthetic"
    else:
        from storage.loader.loader import dataset_fingerprint
        from storage.manifest import read_manifest

        data_fp = dataset_fingerprint(read_manifest(cfg.data.dataset))
    p = cfg.parallel
    what = {"dataset": data_fp, "teacher": checkpoint_hash(teacher_ckpt), "top_k": cfg.distill.top_k,
            "objective": cfg.objective, "data": dataclasses.asdict(cfg.data), "seed": cfg.seed, "steps": cfg.steps,
            "global_batch_size": p.global_batch_size, "batch_rampup": p.batch_rampup,
            "document_masking": cfg.document_masking(), "synthetic": cfg.debug.synthetic_data}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_dir(cfg, teacher_ckpt: str) -> str:
    base = cfg.run_dir if cfg.debug.synthetic_data or not cfg.data.dataset else cfg.data.dataset
    return os.path.join(base, "teacher", fingerprint(cfg, teacher_ckpt))


def row_keys(rows: torch.Tensor) -> list[bytes]:
    """The key of each row of a micro-batch (one copy to the host for all of them)."""
    host = rows.detach().to("cpu", torch.int64).contiguous().numpy()
    return [xxhash.xxh3_128_digest(r.tobytes()) for r in host]


def complete(cfg) -> bool:
    """Whether the run's cache exists (written to the end; its checksums are checked when it is loaded)."""
    return os.path.isfile(os.path.join(cache_dir(cfg, cfg.distill.teacher), "cache.json"))


def compute(cfg, par, teacher, data: str, loader, batches, log=print) -> str:
    """Run `teacher` (train.objectives.teacher.Teacher) over every row the run reads (this rank's `loader`
    of rows of kind `data`, fresh; `batches`: the run's train.rampup.BatchSizes) and write the cache;
    collective over all ranks; returns the folder."""
    import torch.distributed as dist

    from storage import atomic
    from train.objectives.teacher import document_settings, keep_fn

    folder = cache_dir(cfg, cfg.distill.teacher)
    os.makedirs(folder, exist_ok=True)
    writer = par.is_last_stage and par.tp_rank == 0
    part = os.path.join(folder, f"dp{par.dp_rank:05d}")
    docs, keep = document_settings(cfg, data, teacher.chunks), keep_fn(cfg, teacher.model_cfg.resolved().vocab_size)
    mbs, rows, shape = cfg.parallel.micro_batch_size, 0, None
    files = {}
    try:
        if writer:
            files = {n: atomic.AtomicFile(f"{part}.{n}") for n in ("keys", "values", "ids")}
        consumed = 0
        for step in range(cfg.steps):
            gbs = batches.at(consumed)
            batch = batches.take(loader, gbs)
            consumed += gbs  # distillation reads rows of seq_len: a step consumes its global batch
            micro = list(batch.to(par.device).split(mbs))
            outs = teacher.outputs(micro, docs, keep)
            if writer:
                for m, (v, i) in zip(micro, outs):
                    v, i = v.reshape(len(m), -1, v.shape[-1]), i.reshape(len(m), -1, i.shape[-1])
                    shape = tuple(v.shape[1:])
                    files["keys"].file.write(b"".join(row_keys(m)))
                    files["values"].file.write(v.to("cpu", torch.float32).contiguous().numpy().tobytes())
                    files["ids"].file.write(i.to("cpu", torch.int32).contiguous().numpy().tobytes())
                    rows += len(m)
            if par.rank == 0 and (step + 1) % max(1, cfg.steps // 10) == 0:
                log(f"teacher top-{cfg.distill.top_k}: {step + 1}/{cfg.steps} steps")
        for f in files.values():
            f.commit()
    except BaseException:
        for f in files.values():
            f.abort()
        raise
    finally:
        loader.close()
    if writer:
        meta = {"rows": rows, "positions": shape[0] if shape else 0, "k": cfg.distill.top_k,
                "sha256": {n: file_sha256(f"{part}.{n}") for n in ("keys", "values", "ids")}}
        atomic.write_bytes(f"{part}.json", json.dumps(meta, indent=1).encode())
    if dist.is_initialized():
        dist.barrier()
    if par.rank == 0:
        parts = sorted(n[:-5] for n in os.listdir(folder) if n.startswith("dp") and n.endswith(".json"))
        atomic.write_bytes(os.path.join(folder, "cache.json"), json.dumps({
            "teacher": cfg.distill.teacher, "dataset": cfg.data.dataset, "top_k": cfg.distill.top_k,
            "fingerprint": os.path.basename(folder), "parts": parts}, indent=1).encode())
    if dist.is_initialized():
        dist.barrier()
    return folder


class TeacherCache:
    """A complete cache, memory-mapped: `outputs(micro, varlen)` → (values, ids) per micro-batch, shaped as
    the teacher's own top-k outputs under the run's document masking."""

    def __init__(self, folder: str, device):
        index = os.path.join(folder, "cache.json")
        if not os.path.isfile(index):
            raise TeacherCacheError(f"{folder}: no complete teacher cache (cache.json is missing); `train "
                                    "teacher-cache CONFIG` writes it (`train launch` does, before training)")
        with open(index) as f:
            self.meta = json.load(f)
        self.folder, self.device = folder, device
        self.rows: dict[bytes, tuple[int, int]] = {}
        self.values, self.ids = [], []
        for p, name in enumerate(self.meta["parts"]):
            base = os.path.join(folder, name)
            with open(base + ".json") as f:
                m = json.load(f)
            for n, want in m["sha256"].items():
                if file_sha256(f"{base}.{n}") != want:
                    raise TeacherCacheError(f"{base}.{n}: sha256 mismatch (corrupt); delete {folder} to recompute")
            shape = (m["rows"], m["positions"], m["k"])
            if m["rows"] == 0:
                self.values.append(None)
                self.ids.append(None)
                continue
            self.values.append(np.memmap(base + ".values", dtype=np.float32, mode="r", shape=shape))
            self.ids.append(np.memmap(base + ".ids", dtype=np.int32, mode="r", shape=shape))
            keys = np.fromfile(base + ".keys", dtype=np.uint8).reshape(m["rows"], 16)
            for j in range(m["rows"]):
                self.rows.setdefault(keys[j].tobytes(), (p, j))

    def outputs(self, micro: list[torch.Tensor], varlen: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for m in micro:
            at = []
            for r, key in zip(m, row_keys(m)):
                hit = self.rows.get(key)
                if hit is None:
                    raise TeacherCacheError(
                        f"{self.folder}: holds no teacher outputs for a row this run reads (its first tokens: "
                        f"{r.reshape(-1)[:8].tolist()}); the cache was written for other data: delete it to recompute")
                at.append(hit)
            v = np.stack([self.values[p][j] for p, j in at])
            i = np.stack([self.ids[p][j] for p, j in at])
            if varlen:  # one packed sequence per micro-batch, as the model sees it
                v, i = v.reshape(1, -1, v.shape[-1]), i.reshape(1, -1, i.shape[-1])
            out.append((torch.from_numpy(v).to(self.device), torch.from_numpy(i.astype(np.int64)).to(self.device)))
        return out
