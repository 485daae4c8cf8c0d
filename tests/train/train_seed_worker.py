"""torchrun worker for test_train_parallel: draws from each RNG stream after train.model.parallel.init."""
from train.model import cpu_compat

cpu_compat.install()


def main() -> None:
    import json
    import sys

    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from storage.config import from_dict
    from train.model import parallel
    from train.config import TrainConfig

    cfg = from_dict(TrainConfig, {"parallel": {"tp": 2}, "seed": 42})
    info = parallel.init(cfg)
    default = torch.rand(4).tolist()
    with get_cuda_rng_tracker().fork():
        tp_stream = torch.rand(4).tolist()
    with get_cuda_rng_tracker().fork("data-parallel-rng"):
        dp_stream = torch.rand(4).tolist()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"tp_rank": info.tp_rank, "default": default, "tp": tp_stream, "dp": dp_stream})
    if info.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    parallel.shutdown()


if __name__ == "__main__":
    main()
