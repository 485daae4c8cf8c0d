"""Typed config of where a build runs (`executor:`): local processes, a Slurm job chain or a Ray cluster."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from storage.config import ConfigError


@dataclass
class SlurmSettings:
    partition: str = "cpu"
    time: str = "04:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: int = 2
    job_name: str = "datapipe"
    venv_path: str | None = None  # venv (folder or its bin/activate) the jobs run in; None: the building python
    sbatch_args: dict[str, str] = field(default_factory=dict)
    wait: bool = False  # stay until the job chain has finished and report failed tasks (also `--wait`)
    retries: int = 1  # with wait: resubmissions of the chain after a failure (finished tasks are kept)

    def validate(self) -> None:
        if self.retries < 0:
            raise ConfigError(f"key 'executor.slurm.retries': must be >= 0, got {self.retries}")


@dataclass
class RaySettings:
    address: str | None = None  # None: start a local Ray; else join that cluster (e.g. 10.0.0.1:6379)
    num_cpus: int | None = None  # CPUs of a local Ray (None: all); a joined cluster has its own
    cpus_per_task: int = 1
    max_retries: int = 3  # reruns of a task whose worker process or node died (not of one that raised)

    def validate(self) -> None:
        if self.max_retries < 0:
            raise ConfigError(f"key 'executor.ray.max_retries': must be >= 0, got {self.max_retries}")


@dataclass
class ExecutorConfig:
    kind: Literal["local", "slurm", "ray"] = "local"
    workers: int = 1  # tasks at once on the local executor (Ray and Slurm: as many as the cluster's CPUs)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    ray: RaySettings = field(default_factory=RaySettings)
