"""Asynchronous sharded saves through megatron dist_checkpointing.

A save has three phases:
1. stage (training waits): build the sharded state dict, take a copy of the small state (train state,
   RNG states; written to train_state.pt and rng/rankN.pt in phase 2), plan the write
   (`dist_checkpointing.save(async)`), and start the copy of every tensor to reused host buffers; the
   copy runs beside the next forward/backward, and training waits for it only if it is not done when the
   optimizer is about to step (`wait_staged`);
2. write (background thread): the AsyncRequest's write function (raw tensor bytes for full checkpoints,
   XOR deltas in byte planes for incremental ones; torch_dist for full ones with a flattened optimizer state);
3. finalize (all ranks, at a later step once every rank's write finished): megatron's finalize functions
   (global metadata), then rank 0 commits in its background thread: checksums, manifest, fsync, rename,
   `latest` (layout.commit).
A write that fails on any rank is reported by every rank and the checkpoint is never committed.
"""
from __future__ import annotations

import copy
import logging
import multiprocessing.managers
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory,
                                                      apply_factories)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from storage import atomic
from storage.lifecycle import managers_die_with_parent
from train.checkpoint import layout, state_io
from train.checkpoint.config import CheckpointConfig
from train.checkpoint.incremental import raw_snapshot
from train.checkpoint.strategies import DeltaSaveStrategy, RawSaveStrategy, main_pieces, stage, walk
from train.state import TrainState

log = logging.getLogger("train.checkpoint")
FAIL_ENV = "SMOLTRAIN_CKPT_FAIL_WRITE_AT_STEP"  # fault injection for tests: the write of that step raises
LAG_ENV = "SMOLTRAIN_CKPT_LAG_S"  # fault injection for tests: ranks > 0 sleep this long after a save's gather
# distributed-optimizer formats whose state is flattened ShardedTensors: saved by torch_dist
FLATTENING = ("dp_reshardable", "fully_sharded_model_space")


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_int(value: int, op) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    # NCCL reduces device tensors only; gloo host tensors.
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=op)
    return int(t.item())


_RENDEZVOUS = "_smoltrain_after_empty_check"


def _after_empty_check() -> ShardedTensorFactory:
    """A barrier that megatron's `dist_checkpointing.save` runs right after its emptiness check.

    Why megatron said "Overwriting old incomplete / corrupted checkpoint..." on healthy async saves: its
    `save()` starts with rank 0 alone checking that the checkpoint folder is empty (`iterdir`), with no
    synchronisation against the other ranks. Rank 0 creates `.tmp-step_N` empty and all ranks meet at a
    barrier, but then each rank calls `save()` on its own. On every save after a Saver's first one
    (`validate_access_integrity=False`: no all-gather inside `save()`) a faster rank returns from `save()`
    at once (async) and starts writing into the folder (its `rng/` directory, its tensor file; under PP>1
    also megatron's `_extra_state` objects of its stage) before rank 0 has looked. Rank 0 then sees a
    folder that is not empty and warns, although nothing old is overwritten (a race: it showed about once
    per TP=2 `train launch` of `make demo`). The first save was immune: its validation all-gather comes after
    the check. The fix puts a barrier at the same place: `save()` builds factories (`apply_factories`,
    the first step of its preprocessing) after the check and before any write, so every rank waits there
    until rank 0 has checked. The factory builds a `LocalNonpersistentObject`, which megatron drops from
    the checkpoint: nothing is written for it and loading never sees it."""
    def build(key, data, replica_id, flattened_range):
        barrier()
        return LocalNonpersistentObject(None)

    return ShardedTensorFactory(_RENDEZVOUS, torch.empty(0), build, lambda sub: sub, replica_id=0)


@dataclass
class PendingSave:
    step: int
    kind: str
    base: str | None
    tmp: str
    request: AsyncRequest
    future: Future
    strategy: object
    new_base: dict | None  # raw full saves: a map of the written file, the base of later incrementals
    stall_s: float
    staged_bytes: int
    info: dict = field(default_factory=dict)
    staging: Future | None = None  # lazy staging: the host copy, running beside the next forward/backward

    @property
    def name(self) -> str:
        return layout.ckpt_name(self.step)


def _run_request(req: AsyncRequest, step: int, staging: Future | None, small: dict[str, object]) -> None:
    for path, obj in small.items():  # copies taken at stage time (train_state.pt, rng/rankN.pt)
        torch.save(obj, path)
    if staging is not None:
        staging.result()  # the host copy the write reads
    if os.environ.get(FAIL_ENV) == str(step):
        raise OSError(f"injected write failure at step {step} ({FAIL_ENV})")
    # req.preload_fn (megatron's device→host copy) is not needed: stage() already made host copies.
    args = list(req.async_fn_args)
    if req.async_fn is not None:
        req.async_fn(*args, **req.async_fn_kwargs)
    # torch_dist reports a failed write through a results queue that megatron reads in its (collective)
    # finalize; peek at it here so every rank learns about the failure before any collective runs.
    if len(args) == 3 and hasattr(args[2], "get"):
        result = args[2].get()
        args[2].put(result)
        if isinstance(result, Exception):
            raise result


class Saver:
    """At most one save in flight; `poll` finalizes it once all ranks have written."""

    def __init__(self, root: str, cfg: CheckpointConfig, meta: dict | None = None):
        self.root, self.cfg, self.meta = root, cfg, meta or {}
        self.rank, self.world = rank_world()
        self.pending: PendingSave | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="ckpt-stage")
        self._staging_bufs: dict[tuple, torch.Tensor] = {}  # host buffers of lazy staging, reused by every save
        self._validated = False
        self._commits: list[Future] = []
        self.failed: list[str] = []  # messages of saves that were not committed
        self.last_stall_s = 0.0
        self.last_tensor_write: tuple[int, float] | None = None  # (bytes, seconds) of the last raw full save
        # torch_dist's async writer starts a spawn-based results queue on first use: a process that re-imports
        # the entry module (torch and megatron: seconds of CPU). Only the sharding types that flatten the
        # distributed optimizer's state save through torch_dist; for those it is started here, before training,
        # instead of inside the first save's stall. Other runs never start it.
        if cfg.distrib_optim_sharding_type in FLATTENING:
            self._start_results_queue()

    @staticmethod
    def _start_results_queue() -> None:
        """megatron's results queue for torch_dist saves, its Manager process set to die with this one (else
        a kill -9 of training leaves it behind)."""
        try:
            from megatron.core.dist_checkpointing.strategies import filesystem_async
            with managers_die_with_parent(multiprocessing.managers):
                filesystem_async._get_write_results_queue()
        except (ImportError, AttributeError):  # a megatron without it: started by megatron on first save
            log.debug("megatron results queue not pre-started")

    def start(self, state: TrainState, kind: str, base_name: str | None, base: dict | None) -> PendingSave:
        assert self.pending is None, "a save is already in flight"
        t0 = time.perf_counter()
        step = state.step
        tmp = layout.tmp_dir_for(self.root, step)
        if self.rank == 0:
            atomic.clear_stale(tmp)  # an earlier attempt at this step's save
            os.makedirs(tmp)
        barrier()
        sd = state_io.sharded_state_dict(state, self.cfg.distrib_optim_sharding_type, is_loading=False)
        apply_factories(sd)
        try:
            main_pieces(sd)
            torch_dist = False
        except NotImplementedError:  # flattened optimizer state: only torch_dist can write it (full saves)
            torch_dist = True
        if kind == "incremental":
            strategy = DeltaSaveStrategy(self.rank, base, self.cfg.compression_level)
        elif not torch_dist:
            strategy = RawSaveStrategy(self.rank)
        else:
            self._start_results_queue()  # (a no-op once started)
            strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
        # A sync save of host tensors writes straight from them (training waits anyway). An async one copies
        # them to reused host buffers in the background: parameters and optimizer states only change in
        # the optimizer step, and the training loop calls `wait_staged` (CheckpointManager.before_update)
        # before it. A torch_dist save, or state on a GPU, is staged eagerly into fresh host memory.
        staged, staging = 0, None
        host = self._host_only(sd)
        if self.cfg.async_save and not torch_dist and host:
            staged, staging = self._stage_lazily(sd)
        elif self.cfg.async_save or torch_dist or not host:  # our writers read host memory
            staged = stage(sd)
        # the sharding layout is validated (an all-gather of every tensor's metadata) on a Saver's first save
        if self.world > 1:
            sd[_RENDEZVOUS] = _after_empty_check()
        req = dist_checkpointing.save(sd, tmp, sharded_strategy=strategy, async_sharded_save=True,
                                      validate_access_integrity=not self._validated)
        self._validated = True
        # the small per-rank files go in after megatron has checked that the folder is empty (the rendezvous
        # above); their content is copied now (the training loop changes it next step) and serialized by
        # the writer thread
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        small = {os.path.join(tmp, "rng", f"rank{self.rank:05d}.pt"): copy.deepcopy(state_io.rng_state())}
        if self.rank == 0:
            small[os.path.join(tmp, "train_state.pt")] = copy.deepcopy(state_io.train_state_dict(state))
        future = self._writer.submit(_run_request, req, step, staging, small)
        stall = time.perf_counter() - t0
        self.last_stall_s = stall
        self.pending = PendingSave(step, kind, base_name if kind == "incremental" else None, tmp, req, future,
                                   strategy, None, stall, staged, {"full_bytes": staged}, staging)
        return self.pending

    @staticmethod
    def _host_only(sd) -> bool:
        devices = set()
        walk(sd, lambda v: devices.add(v.data.device.type) if isinstance(v, ShardedTensor) else None)
        return devices <= {"cpu"}

    def _stage_lazily(self, sd) -> tuple[int, Future]:
        """Point every ShardedTensor at its reused host buffer and fill the buffers in the background."""
        jobs = []

        def swap(v):
            if isinstance(v, ShardedTensor):
                src = v.data.detach()
                ident = (v.key, tuple(v.global_offset), tuple(src.shape), src.dtype)
                buf = self._staging_bufs.get(ident)
                if buf is None:
                    buf = self._staging_bufs[ident] = torch.empty(src.shape, dtype=src.dtype)
                jobs.append((buf, src))
                v.data = buf
        walk(sd, swap)

        def copy_all():
            for buf, src in jobs:
                buf.copy_(src)  # torch's parallel copy: measured ~4x less stall than a one-thread copy
        return sum(b.numel() * b.element_size() for b, _ in jobs), self._stager.submit(copy_all)

    def wait_staged(self) -> float:
        """Block until the save in flight has its host copy (call before the state changes). Seconds waited;
        they count as stall of that save."""
        p = self.pending
        if p is None or p.staging is None or p.staging.done():
            return 0.0
        t = time.perf_counter()
        wait([p.staging])
        waited = time.perf_counter() - t
        p.stall_s += waited
        self.last_stall_s = p.stall_s
        return waited

    def poll(self, block: bool) -> PendingSave | None:
        """Finalize the save in flight if every rank finished writing (or wait for that with `block`).
        Returns the finalized PendingSave (check `.info['ok']`), or None if nothing was finalized."""
        p = self.pending
        if p is None:
            return None
        if block:
            wait([p.future])
        elif all_reduce_int(int(p.future.done()), dist.ReduceOp.MIN) == 0:
            return None
        self.pending = None
        err = p.future.exception()
        any_err = all_reduce_int(int(err is not None), dist.ReduceOp.MAX)
        if not any_err:
            try:
                for fn in p.request.finalize_fns:
                    fn()
            except Exception as e:  # noqa: BLE001 - reported below, checkpoint not committed
                err, any_err = e, 1
        if any_err:
            msg = (f"checkpoint {p.name} ({p.kind}) was NOT saved: background write failed"
                   + (f" on rank {self.rank}: {err!r}" if err is not None else " on another rank"))
            log.error(msg, exc_info=err)
            self.failed.append(msg)
            if self.rank == 0:
                shutil.rmtree(p.tmp, ignore_errors=True)
            p.info["ok"] = False
            return p
        # Map this rank's tensor file before the gather below: once every rank has passed it, rank 0 may
        # commit (rename the folder) while a slower rank would still be opening the old path.
        if isinstance(p.strategy, RawSaveStrategy):
            p.new_base = raw_snapshot(p.tmp, self.rank)
        stats = getattr(p.strategy, "stats", None) or {"written": p.info["full_bytes"], "full": p.info["full_bytes"]}
        gathered = [stats]
        if self.world > 1:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, stats)
            if self.rank > 0 and os.environ.get(LAG_ENV):
                time.sleep(float(os.environ[LAG_ENV]))  # a slow rank: rank 0 commits meanwhile
        info = {"layout": state_io.layout(), "meta": self.meta, "stall_s": round(p.stall_s, 4),
                "tensor_bytes": {"written": sum(s.get("written", 0) for s in gathered),
                                 "full": sum(s.get("full", 0) for s in gathered)}}
        hashed = {rel: v for s in gathered for rel, v in s.get("files", {}).items()}  # hashed while written
        if isinstance(p.strategy, RawSaveStrategy):  # raw full save: tensor bytes and the slowest rank's write
            self.last_tensor_write = (sum(s["written"] for s in gathered), max(s["write_s"] for s in gathered))
        p.info["ok"] = True
        if self.rank == 0:
            self._commits.append(self._committer.submit(self._commit, p, info, hashed))
        return p

    def _commit(self, p: PendingSave, info: dict, hashed: dict) -> dict:
        try:
            m = layout.commit(p.tmp, self.root, p.step, p.kind, p.base, info, hashed)
        except Exception as e:
            msg = f"checkpoint {p.name}: commit failed, not saved: {e!r}"
            log.error(msg, exc_info=e)
            self.failed.append(msg)
            raise
        tb = info["tensor_bytes"]
        log.info("checkpoint %s (%s%s) committed: tensors %d of %d bytes written (%.1f%%), stall %.3fs",
                 p.name, p.kind, f" on {p.base}" if p.base else "", tb["written"], tb["full"],
                 100.0 * tb["written"] / max(tb["full"], 1), p.stall_s)
        if self.on_commit is not None:
            self.on_commit(m)
        return m

    on_commit = None  # callable(manifest), set by the manager: retention and offload

    def wait_commits(self) -> None:
        wait(self._commits)  # failures were reported in _commit
        self._commits.clear()

    def close(self) -> None:
        self.poll(block=True)
        self.wait_commits()
        self._writer.shutdown(wait=True)
        self._committer.shutdown(wait=True)
        self._stager.shutdown(wait=True)
