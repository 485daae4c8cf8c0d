"""Start training: torchrun on this machine (one or more "nodes" through c10d rendezvous), or Slurm.

`train launch` validates everything that can be validated before a process starts (config, world size,
dataset), writes the resolved config into the run dir, then runs
`python -m torch.distributed.run ... -m train.run RUN_DIR/config.yaml`; library warnings and megatron's
messages go to RUN_DIR/logs/rank<RANK>.log (train.monitor.console), the console keeps progress and errors.
`--slurm` writes an sbatch script (one task per node: srun → torchrun with c10d rendezvous on the first
node, `--requeue`, NCCL env).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from storage import config as cfgmod
from train.monitor import console
from train import objectives
from train.config import SlurmConfig, TrainConfig


def default_nproc() -> int:
    """GPUs on this node, or 1 on CPU."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def prepare(cfg: TrainConfig, nproc: int, nnodes: int) -> Path:
    """Validate for world = nproc × nnodes and the dataset; write RUN_DIR/config.yaml; return its path.
    With `init`, the checkpoint is verified and the model shape taken from it first (in place)."""
    from train.checkpoint.init_from import resolve as resolve_init

    resolve_init(cfg)
    cfg.check_world(nproc * nnodes)
    cfg.check_data()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    cfgmod.save(cfg, path, shared=nnodes > 1)  # every node's launcher writes it, maybe at the same time
    return path


def torchrun_command(cfg: TrainConfig, config_path: str | os.PathLike, nproc: int, nnodes: int,
                     node_rank: int | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    lc = cfg.launch
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and node_rank is None:
        cmd.append("--standalone")  # a free local port: several single-node runs may share a machine
    else:
        cmd += [f"--nnodes={nnodes}", f"--rdzv-backend={lc.rdzv_backend}", f"--rdzv-endpoint={lc.rdzv_endpoint}",
                f"--rdzv-id={lc.rdzv_id}"]
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    return cmd + ["-m", "train.run", str(config_path), *extra]


def launch(cfg: TrainConfig, nproc: int | None = None, nnodes: int | None = None, node_rank: int | None = None,
           dry_run: bool = False, pass_only: bool = False) -> int:
    """Validate, write RUN_DIR/config.yaml and train under torchrun; returns the exit code. An objective
    that needs a pass over the data first (Objective.needs_pass: e.g. a teacher cache to fill) gets it
    here, in its own processes (`train.run --pass`); `pass_only` runs that pass alone."""
    nproc = nproc or cfg.launch.nproc or default_nproc()
    nnodes = nnodes or cfg.launch.nnodes
    node_rank = node_rank if node_rank is not None else cfg.launch.node_rank
    path = prepare(cfg, nproc, nnodes)
    cmds = [torchrun_command(cfg, path, nproc, nnodes, node_rank)]
    if pass_only or objectives.get(cfg.objective).needs_pass(cfg):
        cmds = [torchrun_command(cfg, path, nproc, nnodes, node_rank, ("--pass",))] + ([] if pass_only else cmds)
    for cmd in cmds:
        print("+ " + shlex.join(cmd), flush=True)
    if dry_run:
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # each rank (and its checkpoint-writer helpers) logs library warnings and megatron's messages to
    # RUN_DIR/logs/rank<RANK>.log from its first import on (train.monitor.console)
    env[console.ENV_DIR] = str((Path(cfg.run_dir) / "logs").resolve())
    for cmd in cmds:
        rc = subprocess.call(cmd, env=env)
        if rc:
            return rc
    return 0


def sbatch_header(s: SlurmConfig, output: str | os.PathLike, nodes: int | None = None,
                  job_name: str | None = None) -> list[str]:
    """The `#SBATCH` lines of `launch.slurm` (one task per node, its GPUs and CPUs), logs to `output`."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name or s.job_name}", f"#SBATCH --nodes={nodes or s.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={s.gpus_per_node}",
             f"#SBATCH --cpus-per-task={s.cpus_per_task}", f"#SBATCH --time={s.time}", f"#SBATCH --output={output}"]
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    if s.requeue:
        lines.append("#SBATCH --requeue")  # preempted/failed nodes: Slurm requeues, train.run auto-resumes
    return lines + [f"#SBATCH {a}" for a in s.extra_sbatch]


def sbatch_prologue(s: SlurmConfig, workdir: str | os.PathLike) -> list[str]:
    """The shell lines before the job's command: strict mode, cd, `launch.slurm.env` exports, `setup`."""
    lines = ["", "set -euo pipefail", f"cd {shlex.quote(str(Path(workdir).resolve()))}"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in s.env.items()]
    return lines + list(s.setup)


def sbatch_script(cfg: TrainConfig, config_path: str | os.PathLike, workdir: str | os.PathLike) -> str:
    s = cfg.launch.slurm
    lines = sbatch_header(s, f"{Path(cfg.run_dir).resolve()}/slurm-%j.out") + sbatch_prologue(s, workdir)
    lines += ['HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}", "",
              f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -m torch.distributed.run \\",
              f"  --nnodes={s.nodes} --nproc-per-node={s.gpus_per_node} \\",
              '  --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:29500" --rdzv-id="$SLURM_JOB_ID" \\',
              f"  -m train.run {shlex.quote(str(Path(config_path).resolve()))}", ""]
    return "\n".join(lines)


def slurm(cfg: TrainConfig, submit: bool) -> Path:
    """Write RUN_DIR/train.sbatch (validated for nodes × gpus_per_node); submit with sbatch if asked."""
    s = cfg.launch.slurm
    path = prepare(cfg, s.gpus_per_node, s.nodes)
    script = Path(cfg.run_dir) / "train.sbatch"
    script.write_text(sbatch_script(cfg, path, os.getcwd()))
    script.chmod(0o755)
    if submit:
        subprocess.run(["sbatch", str(script)], check=True)
    return script
