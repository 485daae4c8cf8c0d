"""torchrun worker (2 processes): logits of imported checkpoints under several TP × PP layouts.

    torchrun --nproc-per-node 2 import_logits_worker.py OUT.pt TOKENS.pt CKPT [CKPT ...]

For each checkpoint and each layout (TP2, PP2, DP2 = TP1 PP1) the model is built from the checkpoint's
recorded config, loaded with `train.checkpoint.init_from.load_weights` (the `--init` path: resharded on
load), run forward-only through megatron's pipeline schedule, and the full-vocabulary logits (gathered
over TP) are saved by rank 0 as {(ckpt, tp, pp): logits}.
"""
from train.model import cpu_compat

cpu_compat.install()

import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def logits_for(ckpt: str, tp: int, pp: int, tokens: torch.Tensor):
    import fsspec
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from train.checkpoint import layout
    from train.checkpoint.init_from import load_weights
    from train.model.gpt import ModelConfig, build_model

    meta = layout.read_manifest(fsspec.filesystem("file"), ckpt)["meta"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1)
    chunks = build_model(ModelConfig(**meta["model"]), tp=tp, pp=pp, seed=99)
    load_weights(chunks, None, ckpt)
    for c in chunks:
        c.eval()
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)
    box = {}

    def fwd(data_iterator, model):
        out = model(tokens, pos, None)

        def loss_func(o):
            box["logits"] = o.detach()
            return o.sum() * 0, {}
        return out, loss_func

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter([None]), model=chunks,
                                    num_microbatches=1, seq_length=tokens.shape[1],
                                    micro_batch_size=tokens.shape[0], forward_only=True)
    full = None
    if ps.is_pipeline_last_stage():
        parts = [torch.empty_like(box["logits"]) for _ in range(tp)]
        dist.all_gather(parts, box["logits"].contiguous(), group=ps.get_tensor_model_parallel_group())
        full = torch.cat(parts, dim=-1)
    ps.destroy_model_parallel()
    return full


def main() -> int:
    out, tok_path, *ckpts = sys.argv[1:]
    dist.init_process_group("gloo")
    tokens = torch.load(tok_path)
    res = {}
    for ckpt in ckpts:
        for tp, pp in ((2, 1), (1, 2), (1, 1)):
            full = logits_for(ckpt, tp, pp, tokens)
            box = [full]
            src = 1 if pp == 2 else 0  # PP2: the last stage is rank 1
            dist.broadcast_object_list(box, src=src)
            res[(ckpt, tp, pp)] = box[0]
    if dist.get_rank() == 0:
        torch.save(res, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
