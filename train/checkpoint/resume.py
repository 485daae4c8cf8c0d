"""Resume: pick the newest checkpoint that verifies (local, else pulled from the offload URL) and load it
in place into a TrainState, under any TP/PP/DP layout.

Incremental checkpoints load their base's tensors with torch_dist (which reshards) and then apply their
deltas by global region; the base's values are kept as the base snapshot for later incremental saves.
RNG states are restored only when the layout is unchanged (per-rank streams do not map across layouts).
"""
from __future__ import annotations

import logging
import os

import fsspec
import torch.distributed as dist
from megatron.core import dist_checkpointing

from train.checkpoint import layout, safe_load, state_io
from train.checkpoint.config import CheckpointConfig
from train.checkpoint.strategies import DeltaAwareLoadStrategy
from train.state import TrainState

log = logging.getLogger("train.checkpoint")


def choose_local(root: str, checksums: bool) -> tuple[str | None, list[str]]:
    """Newest checkpoint under root that verifies, and the problems of newer ones that did not."""
    fs = fsspec.filesystem("file")
    skipped = []
    for name in reversed(layout.checkpoint_names(fs, root)):
        problems = layout.verify(fs, root, name, checksums=checksums)
        if not problems:
            return name, skipped
        msg = f"skipping checkpoint {root}/{name}: " + "; ".join(problems[:5])
        log.warning(msg)
        skipped.append(msg)
    return None, skipped


def broadcast_choice(name: str | None) -> str | None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [name]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return name


def load_into(state: TrainState, root: str, name: str, cfg: CheckpointConfig, restore_rng: bool = True) -> dict:
    """Load checkpoint `name` into `state` in place. Returns {'base_name', 'base_snapshot', 'manifest'}.
    restore_rng=False: weights and counters only (evaluation), RNG streams left alone."""
    path = os.path.join(root, name)
    m = layout.read_manifest(fsspec.filesystem("file"), path)
    base_name = m["base"] or name
    try:
        strategy = _load_tensors(state, path, m, cfg.distrib_optim_sharding_type)
    except Exception as e:
        raise layout.CheckpointError(f"{path}: load failed (base {base_name}): {e}") from e
    ts = safe_load.load_torch(os.path.join(path, "train_state.pt"))  # never code from a checkpoint's pickle
    state_io.load_train_state(state, ts)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    rng_file = os.path.join(path, "rng", f"rank{rank:05d}.pt")
    if not restore_rng:
        pass
    elif m.get("layout") == state_io.layout() and os.path.exists(rng_file):
        state_io.set_rng_state(safe_load.load_torch(rng_file))
    elif rank == 0:
        log.warning("checkpoint %s: parallel layout changed (%s -> %s): RNG states not restored",
                    name, m.get("layout"), state_io.layout())
    if rank == 0:
        log.info("resumed from checkpoint %s (%s, step %d)%s", name, m["kind"], m["step"],
                 f", {strategy.pieces_applied} delta pieces on {base_name}" if m["kind"] == "incremental" else "")
    return {"base_name": base_name, "base_snapshot": strategy.base_snapshot, "manifest": m}


def _load_tensors(state: TrainState, path: str, m: dict, sharding_type: str) -> DeltaAwareLoadStrategy:
    """Model chunks and optimizer of checkpoint folder `path` (manifest `m`) into `state`, under this
    process's layout (resharded). Returns the strategy (its base snapshot)."""
    root, name = os.path.split(path)
    strategy = DeltaAwareLoadStrategy(os.path.join(root, m["base"] or name), path if m["kind"] == "incremental" else None)
    sd = state_io.sharded_state_dict(state, sharding_type, is_loading=True)
    loaded = dist_checkpointing.load(sd, path, sharded_strategy=strategy)
    state_io.apply_loaded(state, loaded)
    return strategy


def load_model_and_optimizer(state: TrainState, path: str, sharding_type: str) -> dict:
    """A new stage with --keep-optimizer (`init_keep_optimizer`): the model weights and the optimizer state
    (AdamW moments and step, bf16 main parameters) of checkpoint folder `path`, loaded as resume does (any
    TP/PP/DP layout, resharded). Nothing else: step, LR schedule, loader and RNG streams stay fresh, and the
    optimizer's hyper-parameters (lr, betas, eps, weight decay) stay this run's config. Returns the
    checkpoint's manifest. Collective: every rank calls it."""
    path = os.path.abspath(path.rstrip("/"))
    m = layout.read_manifest(fsspec.filesystem("file"), path)
    groups = [{k: v for k, v in g.items() if k not in ("params", "step")}
              for opt in state_io.inner_optimizers(state.optimizer) for g in opt.optimizer.param_groups]
    try:
        _load_tensors(state, path, m, sharding_type)
    except Exception as e:
        raise layout.CheckpointError(
            f"--keep-optimizer: loading the model and optimizer state of {path} failed ({e}); the optimizer "
            "state must match this run's kind (parallel.distributed_optimizer, "
            "checkpoint.distrib_optim_sharding_type) and precision; TP/PP/DP may differ. Start without "
            "--keep-optimizer (init_keep_optimizer: false) for weights only") from e
    # torch's load_state_dict replaces the param group dicts with the checkpoint's: put this run's values back
    new = [g for opt in state_io.inner_optimizers(state.optimizer) for g in opt.optimizer.param_groups]
    for g, hp in zip(new, groups, strict=True):
        g.update(hp)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        log.info("new stage from checkpoint %s (step %d): weights and optimizer state", path, m["step"])
    return m
