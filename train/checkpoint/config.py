"""CheckpointConfig: the typed `checkpoint:` section of a training config (loaded by storage.config)."""
from __future__ import annotations

from dataclasses import dataclass

from storage.config import ConfigError


@dataclass
class CheckpointConfig:
    """Where and how often checkpoints are written, how many are kept, and where they are offloaded.

    dir: checkpoint folder; relative paths are taken relative to the run directory.
    full_every: a self-contained full checkpoint every N steps (0: never by cadence).
    incremental_every: an incremental checkpoint (deltas against the last full one) every M steps in between
      (0: off). A step that is a multiple of both gets a full checkpoint.
    keep_last: the newest k checkpoints are kept; older ones are deleted unless protected.
    keep_full_every: every K-th full checkpoint (step % (K * full_every) == 0) is kept forever (0: none).
    async_save: training blocks only for staging; writing runs in the background.
    offload_url: fsspec URL (s3://bucket/run, file://...) each completed checkpoint is copied to; "" = off.
    keep_local: with offload, local copies beyond the newest keep_local are deleted once the remote verifies.
    verify_on_resume: checksum every file of the chosen checkpoint (and its base) before loading it.
    compression_level: zstd level of the byte planes of incremental deltas that compress (1: zstd's fast
      strategy tuned for exponent bytes; higher levels are zstd's own).
    distrib_optim_sharding_type: DistributedOptimizer format; fully_reshardable is the one that resumes
      bit-exactly and reshards (see notes/megatron-cpu.md).
    """
    dir: str = "checkpoints"
    full_every: int = 1000
    incremental_every: int = 200
    keep_last: int = 3
    keep_full_every: int = 5
    async_save: bool = True
    offload_url: str = ""
    keep_local: int = 2
    verify_on_resume: bool = True
    compression_level: int = 1
    distrib_optim_sharding_type: str = "fully_reshardable"

    def validate(self) -> None:
        for name in ("full_every", "incremental_every", "keep_full_every", "compression_level"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        if self.keep_local < 1:
            raise ConfigError(f"checkpoint.keep_local must be >= 1, got {self.keep_local}")
        if self.distrib_optim_sharding_type not in ("fully_reshardable", "dp_reshardable",
                                                    "fully_sharded_model_space"):
            raise ConfigError("checkpoint.distrib_optim_sharding_type: unknown value "
                              f"{self.distrib_optim_sharding_type!r}")

    def kind_at(self, step: int) -> str | None:
        """'full', 'incremental' or None: what the cadence asks for after `step` optimizer steps."""
        if step <= 0:
            return None
        if self.full_every and step % self.full_every == 0:
            return "full"
        if self.incremental_every and step % self.incremental_every == 0:
            return "incremental"
        return None
