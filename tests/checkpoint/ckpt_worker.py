"""torchrun worker for checkpoint tests: a tiny megatron GPT trained on synthetic tokens with
CheckpointManager saves/resume. Writes the per-step (loss, grad norm) trace as JSON.

    torchrun --nproc-per-node N ckpt_worker.py --run-dir DIR --steps S [--tp --pp --distopt --resume ...]
"""
from train.model import cpu_compat

cpu_compat.install()  # at import: dist_checkpointing's async writer re-imports __main__

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

SEQ, GLOBAL_BATCH, VOCAB = 32, 4, 1024
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")


class SyntheticLoader:
    """Global sequence g is a pure function of g; rank r of DP size d takes its slice of each batch."""

    def __init__(self, dp_rank: int, dp: int):
        self.dp_rank, self.dp, self.consumed = dp_rank, dp, 0

    def next(self):
        per = GLOBAL_BATCH // self.dp
        start = self.consumed + self.dp_rank * per
        seqs = [torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(1000 + g))
                for g in range(start, start + per)]
        self.consumed += GLOBAL_BATCH
        x = torch.stack(seqs)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, sd):
        self.consumed = sd["consumed"]


class StepScheduler:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def build(args):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from train.model.gpt import ModelConfig, build_model
    from train.state import TrainState

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    chunks = build_model(ModelConfig(preset="tiny"), tp=args.tp, pp=args.pp, seed=7)
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    dcfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=args.distopt)
    model = [DistributedDataParallel(c.config, dcfg, c) for c in chunks]
    for m in model:
        m.config.finalize_model_grads_func = finalize_model_grads
    ocfg = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                           use_distributed_optimizer=args.distopt, params_dtype=torch.float32)
    opt = get_megatron_optimizer(ocfg, model)
    loader = SyntheticLoader(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    return TrainState(model=model, optimizer=opt, scheduler=StepScheduler(), loader=loader)


def train_step(state, args):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, labels = (t.to(DEVICE) for t in state.loader.next())
    pos = torch.arange(SEQ, device=DEVICE).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model):
        out = model(tokens, pos, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    for m in state.model:
        m.zero_grad_buffer()
    state.optimizer.zero_grad()
    res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]),
                                      model=state.model, num_microbatches=1, seq_length=SEQ,
                                      micro_batch_size=tokens.shape[0], forward_only=False)
    if MGR is not None:
        MGR.before_update()
    _, gnorm, _ = state.optimizer.step()
    loss = torch.tensor([res[0]["loss"].item() if res else 0.0], dtype=torch.float64, device=DEVICE)
    from megatron.core import parallel_state as ps
    # Last stage holds the loss; average over DP so every layout reports the global mean.
    dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    loss /= ps.get_data_parallel_world_size()
    state.scheduler.n += 1
    state.step += 1
    state.consumed_tokens += GLOBAL_BATCH * SEQ
    return float(loss.item()), float(gnorm)


MGR = None  # the CheckpointManager: train_step calls its before_update() hook
DELAY_ENV = "CKPT_WORKER_RANK0_SAVE_DELAY_S"  # rank 0 enters megatron's save() this late (the race of
# train.checkpoint.save._after_empty_check made certain: the other ranks are in the folder first)


def _delay_rank0_saves(seconds: float) -> None:
    import time

    from megatron.core import dist_checkpointing

    orig = dist_checkpointing.save

    def slow_save(*a, **kw):
        time.sleep(seconds)
        return orig(*a, **kw)
    dist_checkpointing.save = slow_save


NO_RENDEZVOUS_ENV = "CKPT_WORKER_NO_RENDEZVOUS"  # negative control: train.checkpoint.save without its rendezvous


def _drop_rendezvous() -> None:
    """The factory of train.checkpoint.save._after_empty_check without its barrier (the code before the fix)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory

    from train.checkpoint import save

    save._after_empty_check = lambda: ShardedTensorFactory(
        save._RENDEZVOUS, torch.empty(0), lambda *a: LocalNonpersistentObject(None), lambda sub: sub, replica_id=0)


def _capture_megatron_warnings() -> list[str]:
    """Messages megatron's dist_checkpointing logs at WARNING or above in this process."""
    import logging

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())
    lg = logging.getLogger("megatron.core.dist_checkpointing")
    lg.addHandler(Keep(logging.WARNING))
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--distopt", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--full-every", type=int, default=4)
    ap.add_argument("--incremental-every", type=int, default=2)
    ap.add_argument("--keep-last", type=int, default=10)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--offload-url", default="")
    ap.add_argument("--keep-local", type=int, default=2)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--dump-logits", default="", help="TP=PP=1: save logits of fixed tokens after training")
    args = ap.parse_args()

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Bit-exact traces on GPU need deterministic kernels (embedding backward uses atomics otherwise).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    from train.checkpoint import CheckpointConfig, CheckpointManager

    state = build(args)
    if os.environ.get(DELAY_ENV) and dist.get_rank() == 0:
        _delay_rank0_saves(float(os.environ[DELAY_ENV]))
    if os.environ.get(NO_RENDEZVOUS_ENV):
        _drop_rendezvous()
    megatron_warnings = _capture_megatron_warnings()
    cfg = CheckpointConfig(dir="ckpt", full_every=args.full_every, incremental_every=args.incremental_every,
                           keep_last=args.keep_last, keep_full_every=0, async_save=not args.sync,
                           offload_url=args.offload_url, keep_local=args.keep_local)
    global MGR
    mgr = MGR = CheckpointManager(cfg, args.run_dir, meta={"model": {"preset": "tiny"}})
    resumed = mgr.resume(state) if args.resume else False
    trace = {"resumed": resumed, "start": state.step, "steps": {}, "skipped": mgr.skipped}
    while state.step < args.steps:
        loss, gnorm = train_step(state, args)
        trace["steps"][state.step] = [loss, gnorm, state.loader.consumed]
        mgr.maybe_save(state)
    mgr.close()
    trace["failed"] = mgr.failed
    trace["megatron_warnings"] = megatron_warnings
    if args.dump_logits and dist.get_rank() == 0:
        from megatron.core.utils import unwrap_model
        model = unwrap_model(state.model)[0].eval()
        tokens = (torch.arange(0, 2 * SEQ).reshape(2, SEQ) * 37 % VOCAB).to(DEVICE)
        with torch.no_grad():
            logits = model(tokens, torch.arange(SEQ, device=DEVICE).unsqueeze(0).expand_as(tokens), None)
        torch.save({"tokens": tokens.cpu(), "logits": logits.cpu()}, args.dump_logits)
    if dist.get_rank() == 0:
        with open(args.trace, "w") as f:
            json.dump(trace, f)
    del mgr
    from train.model.parallel import shutdown
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
