"""Process groups (TP × PP × DP, and EP inside DP for MoE), seeds per rank, and DDP wrapping.

Seeds follow Megatron-LM (`megatron/training/initialize.py::_set_random_seed`):
- python/numpy/torch default generators: `seed + 100 · pp_rank`, the same on every TP and DP rank of a
  stage (so non-TP regions, e.g. dropout after the all-reduce, agree across TP ranks);
- megatron's tracker (`model_parallel_cuda_manual_seed`): the model-parallel stream is
  `seed + 2718 + tp_rank`, different on every TP rank (dropout inside TP regions, TP-split init).
  SmolLM3 lost a run to TP ranks sharing one seed; tests/train check that these streams differ.
The data seed (data.seed) is separate and shared by all ranks: the loader's order is global.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from train.config import TrainConfig


@dataclass
class ParallelInfo:
    world: int
    rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    num_microbatches: int
    device: torch.device

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init(cfg: TrainConfig) -> ParallelInfo:
    """Start torch.distributed from torchrun's environment and build megatron's process groups."""
    from megatron.core import parallel_state as ps

    cuda = torch.cuda.is_available()
    backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg.check_world(world)
    p = cfg.parallel
    # parallel.ep: experts split over EP ranks inside the data-parallel group (megatron's expert-data-parallel
    # group, DP / EP ranks, reduces the expert grads; the DDP wrapper keeps them in their own buffers)
    ps.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                 expert_model_parallel_size=p.ep)
    info = ParallelInfo(
        world=world, rank=rank, tp=p.tp, pp=p.pp, dp=p.dp(world),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), num_microbatches=p.num_microbatches(world),
        device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"))
    set_seeds(cfg.seed, info)
    return info


def set_seeds(seed: int, info: ParallelInfo) -> None:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * info.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed, force_reset_rng=True)


def wrap_ddp(cfg: TrainConfig, chunks: list) -> list:
    """megatron DDP around each chunk (Float16Module first in bf16 and fp8); grads reduced in fp32."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    dcfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer)
    out = []
    for i, c in enumerate(chunks):
        if torch.cuda.is_available():
            c.cuda(torch.cuda.current_device())
        if cfg.bf16_weights():  # bf16, and fp8 (TE casts to FP8 inside its layers)
            c = Float16Module(c.config, c)
        # Bucketing is off for chunks after the first, as Megatron-LM does for virtual stages.
        out.append(DistributedDataParallel(c.config if hasattr(c, "config") else chunks[i].config, dcfg, c,
                                           disable_bucketing=i > 0))
    return out


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
