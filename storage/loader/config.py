"""`LoaderConfig`: the typed, validated settings of the streaming loader (loadable by storage.config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from storage.config import ConfigError


@dataclass
class LoaderConfig:
    dataset: str = ""                    # dataset folder or fsspec URL (holds manifest.json)
    seq_len: int = 2048                  # tokens per training sequence; rows carry seq_len + 1 tokens
    seed: int = 1234                     # seeds block permutations and window shuffles
    shuffle_window: int = 4096           # sequences of one source shuffled together (per epoch)
    prefetch_threads: int = 8            # threads that read + verify + LZ4-decode blocks
    prefetch_batches: int = 32           # batches planned (blocks requested) ahead of the one being built
    max_bytes_in_flight: int = 512 << 20  # compressed + decoded block bytes the prefetcher may hold
    corruption: Literal["error", "quarantine"] = "error"
    max_substitutes: int = 8             # quarantine: epochs searched for a clean stand-in sequence
    device: str = "cpu"                  # "cpu" or "cuda[:N]": cuda batches come via pinned memory + side stream
    backend: Literal["python", "dali"] = "python"  # dali: blocks read by DALI's webdataset reader

    def validate(self) -> None:
        if not self.dataset:
            raise ConfigError("key 'dataset': required (a dataset folder or URL)")
        for key in ("seq_len", "shuffle_window", "prefetch_threads", "prefetch_batches", "max_bytes_in_flight",
                    "max_substitutes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"key '{key}': must be >= 1, got {getattr(self, key)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"key 'device': expected 'cpu' or 'cuda[:N]', got {self.device!r}")
