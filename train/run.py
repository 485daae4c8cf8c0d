"""Per-process entry point that `train launch` hands to torchrun: `python -m train.run CONFIG [KEY=VALUE...]`.

The CPU compatibility layer is installed at import time, before megatron is imported anywhere: the
async checkpoint writer starts processes with `spawn`, which re-import this module (as `__mp_main__`)
and nothing else. The `__main__` guard keeps those processes from re-running training.
"""
import warnings

from train import cpu_compat

cpu_compat.install()
# megatron warns at every import that TE/Apex are absent (expected on CPU; the local spec is used).
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
warnings.filterwarnings("ignore", message=r".*cuda_graph_scope")


def main(argv: list[str] | None = None) -> int:
    import sys

    from storage import config as cfgmod
    from train.config import TrainConfig
    from train.trainer import run

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m train.run CONFIG [KEY=VALUE ...]", file=sys.stderr)
        return 2
    cfg = cfgmod.load(TrainConfig, argv[0], argv[1:])
    return run(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
