"""Per-process entry point that `train launch` hands to torchrun: `python -m train.run CONFIG [KEY=VALUE...]`.

The console/log-file routing (train.monitor.console) and the CPU compatibility layer are installed at import time,
before megatron is imported anywhere: the async checkpoint writer starts processes with `spawn`, which
re-import this module (as `__mp_main__`) and nothing else. The `__main__` guard keeps those processes from
re-running training. Library warnings and megatron's messages go to RUN_DIR/logs/rank<RANK>.log.
"""
from train.model import cpu_compat
from train.monitor import console

console.quiet()  # before cpu_compat: its install imports megatron, whose import warns
cpu_compat.install()


def main(argv: list[str] | None = None) -> int:
    import os
    import sys

    from storage import config as cfgmod
    from train.config import TrainConfig
    from train.trainer import run

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m train.run CONFIG [--pass] [KEY=VALUE ...]", file=sys.stderr)
        return 2
    only_pass = "--pass" in argv[1:]
    cfg = cfgmod.load(TrainConfig, argv[0], [a for a in argv[1:] if a != "--pass"])
    console.to_file(console.log_path(os.path.join(cfg.run_dir, "logs")))  # no-op when launch named it
    line = console.notice()  # once per run: what megatron's import warnings amount to, where they went
    if line and os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return objective_pass(cfg) if only_pass else run(cfg)


def objective_pass(cfg) -> int:
    """`--pass`: the objective's pass before training (Objective.run_pass), without the student model."""
    from train import objectives
    from train.data import make_loader
    from train.model import parallel
    from train.rampup import BatchSizes

    cfg = cfg.resolved_for_data()
    par = parallel.init(cfg)
    try:
        objective = objectives.get(cfg.objective)
        loader = make_loader(cfg, par, objective.data)
        try:
            objective.run_pass(cfg, par, loader, BatchSizes(cfg.parallel, cfg.data.seq_len, par.dp, par.rank))
        finally:
            loader.close()
        return 0
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    from storage.lifecycle import run_main

    run_main(main)
