"""Streaming token loader: deterministic, elastic, mixed, prefetched and double-buffered.

    from storage.loader import LoaderConfig, TokenLoader
    loader = TokenLoader(LoaderConfig(dataset="s3://bucket/ds", seq_len=2048), global_batch_size=512,
                         dp_rank=rank, dp_size=world)
    batch = next(loader)            # LongTensor [512 // world, seq_len + 1]
    sd = loader.state_dict()        # resume with any dp_size: loader.load_state_dict(sd)

Modules: `order` (per-source epochs, block permutation, window shuffle), `blend` (phases, Megatron-style
low-discrepancy source assignment, schedule changes at resume), `prefetch` (block cache, bytes in
flight, thread pool, the decode arena), `decoders` (decode processes), `pack` (chunks, rows gathered
from the arena, quarantine), `buffers` (two-slot queue, CUDA side-stream copy), `workers` (batch-building
worker processes, zero-copy ring), `loader` (TokenLoader), `torchdata` (use inside a torch DataLoader
with workers), `dali` (optional DALI block reader), `bench` (`storage bench-loader`). See
docs/loader.md.
"""
import importlib

# Imported on first use: the config alone (train.config, every `train` command) must not import torch.
_WHERE = {"LoaderConfig": "config", "TokenLoader": "loader", "TokenIterableDataset": "torchdata"}

__all__ = ["LoaderConfig", "TokenIterableDataset", "TokenLoader"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"storage.loader.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'storage.loader' has no attribute {name!r}")
