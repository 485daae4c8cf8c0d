"""megatron dist_checkpointing strategies for smoltrain's tensor files (`incremental.py`).

RawSaveStrategy (full checkpoints) writes each rank's main-replica tensor pieces as raw bytes in one file
with large sequential writes; DeltaSaveStrategy (incremental checkpoints) writes XOR deltas (byte planes) against
the base's values. Both are async sharded-save strategies: `dist_checkpointing.save` still writes
common.pt, sharded objects and metadata.json as usual. DeltaAwareLoadStrategy fills the requested
tensors from a raw base by global region (any TP/PP/DP layout), or loads a torch_dist base (checkpoints
whose optimizer state is flattened) with megatron's strategy; it records the base values for later
incremental saves and then applies the checkpoint's deltas by global region.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from train.checkpoint import safe_load
from train.checkpoint.incremental import DELTA_DIR, RAW_DIR, Piece, PieceSet, write_deltas, write_raw
from train.checkpoint.planes import bits

DELTA_BACKEND = "smoltrain_delta"
RAW_BACKEND = "smoltrain_raw"


def walk(tree: Any, fn: Callable[[Any], None]) -> None:
    """Call fn on every leaf of nested dicts/lists/tuples."""
    if isinstance(tree, dict):
        for v in tree.values():
            walk(v, fn)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            walk(v, fn)
    else:
        fn(tree)


def walk_pairs(spec: Any, loaded: Any, fn: Callable[[Any, Any], None]) -> None:
    """Walk a sharded state dict and the state dict loaded from it side by side."""
    if isinstance(spec, dict):
        for k, v in spec.items():
            if k in loaded:
                walk_pairs(v, loaded[k], fn)
    elif isinstance(spec, (list, tuple)):
        for a, b in zip(spec, loaded):
            walk_pairs(a, b, fn)
    else:
        fn(spec, loaded)


def main_pieces(sharded_sd: Any) -> list[Piece]:
    """This rank's main-replica tensor pieces (what it writes; other replicas are written elsewhere)."""
    out: list[Piece] = []

    def take(v):
        if isinstance(v, ShardedTensor) and is_main_replica(v.replica_id):
            if v.flattened_range is not None:
                raise NotImplementedError(f"{v.key}: flattened ShardedTensors are not supported by "
                                          "incremental checkpoints; use distrib_optim_sharding_type="
                                          "fully_reshardable")
            out.append(Piece(v.key, tuple(v.global_shape), tuple(v.global_offset), v.data))
    walk(sharded_sd, take)
    return out


def stage(sharded_sd: Any) -> int:
    """Replace every ShardedTensor's data by a host copy, so training may go on while it is written.
    Returns bytes staged. This copy is the only part of a save the training loop waits for."""
    total = 0

    def copy(v):
        nonlocal total
        if isinstance(v, ShardedTensor):
            v.data = v.data.detach().to("cpu", copy=True)
            total += v.data.numel() * v.data.element_size()
    walk(sharded_sd, copy)
    return total


def map_tree(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: map_tree(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tree(v, fn) for v in tree)
    return fn(tree)


class RawSaveStrategy(AsyncSaveShardedStrategy):
    """Writes main-replica tensors as raw bytes (`incremental.write_raw`): a self-contained full checkpoint."""

    def __init__(self, rank: int):
        super().__init__(RAW_BACKEND, 1)
        self.rank = rank
        self.stats: dict = {}

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        pieces = main_pieces(sharded_state_dict)

        def write():
            self.stats = write_raw(str(checkpoint_dir), self.rank, pieces)
        return AsyncRequest(write, (), [])


class DeltaSaveStrategy(AsyncSaveShardedStrategy):
    """Writes main-replica tensors as deltas against `base` (None: self-contained zstd)."""

    def __init__(self, rank: int, base: dict[tuple, np.ndarray] | None, level: int = 1):
        super().__init__(DELTA_BACKEND, 1)
        self.rank, self.base, self.level = rank, base, level
        self.stats: dict = {}

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        pieces = main_pieces(sharded_state_dict)

        def write():
            self.stats = write_deltas(str(checkpoint_dir), self.rank, pieces, self.base, self.level)
        return AsyncRequest(write, (), [])


class DeltaAwareLoadStrategy(LoadShardedStrategy):
    """Loads `base_dir`'s tensors (raw pieces, or torch_dist) + optional deltas of `delta_dir`; records the
    base values of this rank's main-replica pieces (the base snapshot of later incremental saves)."""

    def __init__(self, base_dir: str, delta_dir: str | None):
        super().__init__()
        self.base_dir, self.delta_dir = base_dir, delta_dir
        self.raw = os.path.isdir(os.path.join(base_dir, RAW_DIR))
        self.inner = None if self.raw else TorchDistLoadShardedStrategy()
        if self.inner is not None:
            safe_load.install()  # torch_dist's metadata and bytes items: no code from the checkpoint
        self.base_snapshot: dict[tuple, np.ndarray] = {}
        self.pieces_applied = 0

    @property
    def can_handle_sharded_objects(self):
        # torch_dist stores sharded objects with the tensors; our strategies leave them to megatron's
        # common strategy, in their own folder.
        return self.delta_dir is None and not self.raw

    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend not in ("torch_dist", DELTA_BACKEND, RAW_BACKEND):
            raise ValueError(f"checkpoint backend {loaded_backend!r} is not torch_dist, {RAW_BACKEND} or "
                             f"{DELTA_BACKEND}")

    def check_version_compatibility(self, loaded_version):
        pass

    def _load_raw(self, sharded_state_dict) -> Any:
        pieces = PieceSet(self.base_dir, RAW_DIR)

        def fill(v):
            if not isinstance(v, ShardedTensor):
                return v
            if v.flattened_range is not None:
                raise ValueError(f"{v.key}: a flattened (dp_reshardable) optimizer state cannot be loaded from "
                                 f"{self.base_dir}, written in the raw full format; use "
                                 "distrib_optim_sharding_type=fully_reshardable")
            target = v.data
            pieces.apply(v.key, tuple(v.global_offset), target)
            if pieces.elements != target.numel():
                raise ValueError(f"{self.base_dir}: {v.key} at offset {tuple(v.global_offset)} shape "
                                 f"{tuple(target.shape)}: the checkpoint covers {pieces.elements} of "
                                 f"{target.numel()} elements")
            return target
        return map_tree(sharded_state_dict, fill)

    def load(self, sharded_state_dict, checkpoint_dir):
        if self.raw:
            loaded = self._load_raw(sharded_state_dict)
        else:
            loaded = self.inner.load(sharded_state_dict, self.base_dir)
        deltas = PieceSet(self.delta_dir, DELTA_DIR) if self.delta_dir else None

        def fix(spec, value):
            if not isinstance(spec, ShardedTensor) or not isinstance(value, torch.Tensor):
                return
            if is_main_replica(spec.replica_id):
                ident = (spec.key, tuple(spec.global_offset), tuple(value.shape))
                self.base_snapshot[ident] = bits(value.detach().to("cpu", copy=True))
            if deltas is not None:
                self.pieces_applied += deltas.apply(spec.key, tuple(spec.global_offset), value)
        walk_pairs(sharded_state_dict, loaded, fix)
        return loaded

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        if self.raw:
            raise NotImplementedError(f"{self.base_dir}: tensor metadata of raw checkpoints is in "
                                      f"{RAW_DIR}/rank*.json")
        return self.inner.load_tensors_metadata(self.base_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir):
        if self.raw:
            raise NotImplementedError(f"{self.base_dir}: see {RAW_DIR}/rank*.json")
        return self.inner.load_sharded_metadata(self.base_dir)

    def remove_sharded_tensors(self, checkpoint_dir, key_prefix):
        raise NotImplementedError
