"""Reference log-probs for preference optimization: computed once, stored beside the dataset.

`train refs REFERENCE_CKPT DATASET` (or the first start of a `objective: dpo` run) scores the summed
completion log-probs of every pair's chosen and rejected side under the reference model, with the
evaluation scorer (any TP × PP × DP layout, rows dealt over DP ranks). The result is a float64 array
[pairs, 2] at DATASET/refs/SPLIT-<dataset fingerprint>-<checkpoint hash>.npy with a JSON beside it (the
fingerprints, the pair count, its sha256); loading checks all of them, so a changed dataset or reference
is refused instead of silently used. The pass writes chunks of CHUNK pairs as it goes and skips the ones
already written, so an interrupted pass resumes. Training then holds one model. `dpo.reference: online`
instead scores each step's pairs with a frozen copy of the reference (`OnlineReference`).

Run as torchrun's worker: `python -m train.objectives.refs SPEC.json` (SPEC written by `train refs`).
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os

import numpy as np
import torch

CHUNK = 2048


class ReferenceError(RuntimeError):
    """Stored reference log-probs that do not match the dataset or the reference checkpoint."""


def checkpoint_hash(ckpt: str) -> str:
    """Content identity of a checkpoint: the sha256 of its manifest (which lists every file's checksum)."""
    import fsspec

    from train.checkpoint import layout

    m = layout.read_manifest(fsspec.filesystem("file"), os.path.abspath(ckpt))
    return hashlib.sha256(json.dumps(m, sort_keys=True, default=str).encode()).hexdigest()[:16]


def refs_path(dataset: str, ckpt: str, split: str = "train") -> str:
    from storage import fs
    from storage.loader.loader import dataset_fingerprint
    from storage.manifest import read_manifest

    fp = dataset_fingerprint(read_manifest(dataset))
    return fs.join(dataset, "refs", f"{split}-{fp}-{checkpoint_hash(ckpt)}.npy")


def _rows(pairs: list) -> list:
    """Scorer rows of the pairs' sides (chosen, rejected, chosen, ...), scored on their completion spans."""
    from train.eval.scorer import Row

    rows = []
    for _, _, ct, cm, rt, rm in pairs:
        for toks, mask in ((ct, cm), (rt, rm)):
            toks = np.asarray(toks, dtype=np.int64)
            lab = np.asarray(mask, dtype=bool)[1:]
            edges = np.flatnonzero(np.diff(np.concatenate([[0], lab.astype(np.int8), [0]])))
            rows.append(Row(toks[:-1].tolist(), toks[1:].tolist(),
                            [(int(a), int(e)) for a, e in zip(edges[::2], edges[1::2])]))
    return rows


def compute(model_chunks: list, par, dataset: str, ckpt: str, split: str = "train", log=print) -> np.ndarray:
    """Score every pair of `split` with the model as loaded (it must hold the reference's weights), write
    the result (rank 0) and return it on every rank. Collective."""
    import torch.distributed as dist

    from storage import atomic, fs
    from storage.loader.pairs import iter_pairs
    from train.eval.scorer import Scorer

    path = refs_path(dataset, ckpt, split)
    pairs = list(iter_pairs(dataset, split))
    scorer = Scorer(model_chunks, par)
    parts = []
    for c0 in range(0, len(pairs), CHUNK):
        part_url = f"{path[:-4]}.part{c0 // CHUNK:06d}.npy"
        if fs.exists(part_url):
            parts.append(np.load(io.BytesIO(fs.read_bytes(part_url))))
            continue
        scores = scorer.score(_rows(pairs[c0:c0 + CHUNK]))
        part = np.array([math.fsum(s) for s in scores], dtype=np.float64).reshape(-1, 2)
        if par.rank == 0:
            buf = io.BytesIO()
            np.save(buf, part)
            atomic.write_bytes(part_url, buf.getvalue())
            log(f"reference log-probs: {min(c0 + CHUNK, len(pairs))}/{len(pairs)} pairs")
        parts.append(part)
    out = np.concatenate(parts) if parts else np.zeros((0, 2))
    if par.rank == 0:
        buf = io.BytesIO()
        np.save(buf, out)
        data = buf.getvalue()
        atomic.write_bytes(path, data)
        atomic.write_bytes(path[:-4] + ".json", json.dumps({
            "dataset": dataset, "split": split, "reference": os.path.abspath(ckpt),
            "checkpoint_hash": checkpoint_hash(ckpt), "pairs": len(out),
            "sha256": hashlib.sha256(data).hexdigest()}, indent=1).encode())
        for k in range(-(-len(pairs) // CHUNK)):
            fsys, part = fs.get_fs(f"{path[:-4]}.part{k:06d}.npy")
            fsys.rm(part)
    if dist.is_initialized():
        dist.barrier()
    return out


def load(dataset: str, ckpt: str, split: str = "train") -> np.ndarray | None:
    """The stored log-probs for (dataset, reference), checked; None when there are none yet."""
    from storage import fs

    path = refs_path(dataset, ckpt, split)
    if not fs.exists(path):
        return None
    meta = json.loads(fs.read_bytes(path[:-4] + ".json"))
    data = fs.read_bytes(path)
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise ReferenceError(f"{path}: sha256 mismatch (corrupt); delete it to recompute")
    out = np.load(io.BytesIO(data))
    if out.shape != (meta["pairs"], 2):
        raise ReferenceError(f"{path}: holds {out.shape}, its JSON says {meta['pairs']} pairs")
    return out


class OnlineReference:
    """A frozen copy of the reference under the training layout: scores a step's local pairs with a
    forward-only pipeline schedule (results on the last stage, where the loss is computed)."""

    def __init__(self, cfg, par, ckpt: str):
        from train.checkpoint.init_from import frozen_model

        self.chunks = frozen_model(cfg.model, cfg, par, ckpt)
        self.par, self.seq_len = par, cfg.data.seq_len

    def logps(self, batch: torch.Tensor, rows_per_micro: int) -> torch.Tensor | None:
        """Summed completion log-probs of every row of this rank's batch ([rows]); None off the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from train.model.docmask import micro_batch
        from train.objectives.preference import sequence_logps

        micro = list(batch.split(rows_per_micro))

        def forward_step(data_iterator, model):
            mb = micro_batch(next(data_iterator).to(self.par.device)[:, :4], document_masking=False, eos_id=None,
                             varlen=False)
            pos = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).expand_as(mb.tokens)
            out = model(mb.tokens, pos, None, labels=mb.labels)

            def collect(token_losses):
                lp, _ = sequence_logps(token_losses.float(), mb.loss_mask)
                return lp.sum(), torch.tensor(1, dtype=torch.int, device=lp.device), {"logps": lp.detach()}
            return out, collect

        with torch.no_grad():
            stores = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=self.chunks,
                num_microbatches=len(micro), seq_length=batch.shape[-1], micro_batch_size=rows_per_micro,
                forward_only=True)
        if not self.par.is_last_stage:
            return None
        return torch.cat([s["logps"] for s in stores])


def main(argv: list[str] | None = None) -> int:
    """torchrun worker of `train refs`: build the model under the spec's layout, load the reference, score."""
    import sys

    from train.model import cpu_compat

    cpu_compat.install()
    from storage import config as cfgmod
    from train.model import parallel
    from train.checkpoint.init_from import load_weights
    from train.config import TrainConfig
    from train.model.gpt import build_model

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    cfg = cfgmod.load(TrainConfig, spec["config"], [])
    par = parallel.init(cfg)
    try:
        chunks = build_model(cfg.model, tp=par.tp, pp=par.pp, bf16=cfg.bf16_weights(), seed=cfg.seed)
        load_weights(chunks, None, spec["reference"])
        for split in spec["splits"]:
            out = compute(chunks, par, cfg.data.dataset, spec["reference"], split,
                          log=(lambda m: print(m, flush=True)) if par.rank == 0 else (lambda m: None))
            if par.rank == 0:
                print(f"{split}: {len(out)} pairs -> {refs_path(cfg.data.dataset, spec['reference'], split)}",
                      flush=True)
        return 0
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    from storage.lifecycle import run_main

    run_main(main)
