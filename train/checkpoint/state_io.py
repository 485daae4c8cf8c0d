"""Gathering a TrainState into a megatron sharded state dict and back, plus the small per-run and per-rank
files (train_state.pt, rng/rankNNNNN.pt: tensors and plain data only, loaded with weights_only=True by
train.checkpoint.safe_load), and the fixes for three megatron-core 0.16.1 DistributedOptimizer resume bugs
(see ../shared/notes/megatron-cpu.md):

1. `state_dict()` asserts one AdamW `step` and fails on a fresh optimizer: states are initialised with
   zeros before the load (they are overwritten by it).
2. fully_reshardable load copies every optimizer state key, including `step`, which the loaded tensors
   lack (KeyError 'step'): the current step is supplied for that copy.
3. Silent: `load_state_dict` gives every parameter the same `step` tensor, so AdamW increments it once
   per parameter per step and the resumed run drifts. Each parameter gets its own copy after the load.
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch

from train.state import TrainState

FIXES_ENV = "SMOLTRAIN_CKPT_DISABLE_DISTOPT_FIXES"  # e.g. "3": tests show that fix 3 matters


def _fix_enabled(n: int) -> bool:
    return str(n) not in os.environ.get(FIXES_ENV, "").split(",")


def inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _is_distributed(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return isinstance(opt, DistributedOptimizer)


def init_empty_optimizer_state(optimizer) -> None:
    """Fix 1: zero AdamW states on a fresh DistributedOptimizer so megatron's state_dict() works."""
    if not _fix_enabled(1):
        return
    for opt in inner_optimizers(optimizer):
        if not _is_distributed(opt) or len(opt.optimizer.state) > 0:
            continue
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                opt.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                          "exp_avg_sq": torch.zeros_like(p)}


def load_optimizer(optimizer, state_dict) -> None:
    """optimizer.load_state_dict with fixes 2 and 3 applied to DistributedOptimizers."""
    patched = []
    if _fix_enabled(2):
        for opt in inner_optimizers(optimizer):
            if not _is_distributed(opt):
                continue
            orig = opt._set_main_param_and_optimizer_states

            def set_states(model_param, tensors, _opt=opt, _orig=orig):
                if "step" not in tensors:
                    current = _opt._get_main_param_and_optimizer_states(model_param)
                    if "step" in current:
                        tensors = {**tensors, "step": current["step"].clone()}
                return _orig(model_param, tensors)
            opt._set_main_param_and_optimizer_states = set_states
            patched.append(opt)
    try:
        optimizer.load_state_dict(state_dict)
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method
    if _fix_enabled(3):
        for opt in inner_optimizers(optimizer):
            if _is_distributed(opt):
                for s in opt.optimizer.state.values():
                    if isinstance(s.get("step"), torch.Tensor):
                        s["step"] = s["step"].clone()


def model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def sharded_state_dict(state: TrainState, sharding_type: str, is_loading: bool) -> dict:
    """{'model' | 'model0'.., 'optimizer'} as megatron's training loop builds it."""
    from megatron.core.utils import unwrap_model

    n = len(state.model)
    sd = {model_key(i, n): m.sharded_state_dict() for i, m in enumerate(unwrap_model(state.model))}
    if state.optimizer is not None:
        if is_loading:
            init_empty_optimizer_state(state.optimizer)
        sd["optimizer"] = state.optimizer.sharded_state_dict(
            sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding_type})
    return sd


def apply_loaded(state: TrainState, loaded: dict) -> None:
    from megatron.core.utils import unwrap_model

    n = len(state.model)
    for i, m in enumerate(unwrap_model(state.model)):
        m.load_state_dict(loaded[model_key(i, n)], strict=True)
    if state.optimizer is not None:
        load_optimizer(state.optimizer, loaded["optimizer"])


def train_state_dict(state: TrainState) -> dict:
    out = {"step": state.step, "consumed_tokens": state.consumed_tokens, "extra": state.extra,
           "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
           "loader": state.loader.state_dict() if state.loader is not None else None}
    objective = state.objective.state_dict() if state.objective is not None else {}
    if objective:  # only objectives that keep state add the key
        out["objective"] = objective
    return out


def load_train_state(state: TrainState, d: dict) -> None:
    state.step, state.consumed_tokens, state.extra = d["step"], d["consumed_tokens"], dict(d["extra"])
    if state.scheduler is not None and d["scheduler"] is not None:
        state.scheduler.load_state_dict(d["scheduler"])
    if state.loader is not None and d["loader"] is not None:
        state.loader.load_state_dict(d["loader"])
    if state.objective is not None:
        state.objective.load_state_dict(d.get("objective", {}))


def rng_state() -> dict:
    """This rank's RNG streams, as tensors and plain data only (the file loads with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.copy()), pos, has_gauss, gauss),
           "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None, "tracker": None}
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    if getattr(tracker, "is_initialized", lambda: True)():
        out["tracker"] = tracker.get_states()
    return out


def set_rng_state(d: dict) -> None:
    random.setstate(d["python"])
    name, keys, *rest = d["numpy"]  # keys: a uint32 tensor (a numpy array in files of older versions)
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(d["torch"])
    if d["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(d["cuda"])
    if d["tracker"] is not None:
        from megatron.core import tensor_parallel
        tensor_parallel.get_cuda_rng_tracker().set_states(d["tracker"])


def layout() -> dict:
    """The parallel layout a checkpoint was written with (RNG states only restore under the same one)."""
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {"world": world, "tp": 1, "pp": 1, "dp": world}
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        out.update(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                   dp=ps.get_data_parallel_world_size())
    return out
