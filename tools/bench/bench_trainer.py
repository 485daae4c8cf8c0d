"""Trainer overhead: tokens/s of our `Trainer.train_step` vs a bare megatron-core loop, same process run.

Both sides train the same model (train.model.gpt.build_model, same init), batch and in-memory data; the
bare loop is what a megatron-core example does: DDP, get_megatron_optimizer, get_forward_backward_func,
optimizer.step(). Ours adds everything `train launch` runs per step (data loader, LR schedule, global
loss all-reduce, grad-norm-before-step, skip/spike checks, metrics). Rounds alternate ABBA; medians.

    python tools/bench/bench_trainer.py [--steps 1] [--rounds 20] [--append docs/benchmarks-history.md]

Goal (issue 5): overhead <= 5 %.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from train.model import cpu_compat

cpu_compat.install()


def _cfg(args):
    from storage.config import from_dict
    from train.config import TrainConfig

    return from_dict(TrainConfig, {
        "run_dir": args.run_dir, "steps": 10**6, "seed": 1,
        "precision": "bf16" if args.bf16 else "fp32",
        "model": {"preset": args.preset, **({"hidden_size": 256, "num_heads": 4, "num_kv_heads": 4,
                                             "ffn_hidden_size": 704} if args.preset == "tiny" else {})},
        "data": {"seq_len": args.seq_len},
        "parallel": {"micro_batch_size": args.mbs, "global_batch_size": args.gbs},
        "optim": {"warmup_steps": 0, "schedule": "constant"},
        "monitor": {"log_every": 10**6, "tensorboard": False},
        "checkpoint": {"full_every": 0, "incremental_every": 0},
        "debug": {"synthetic_data": True}})


def bare_loop(cfg, par):
    """A minimal megatron-core training step over the same model and data."""
    import torch
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from train.data import SyntheticLoader
    from train.model.gpt import build_model
    from train.optim import build_optimizer
    from train.model.parallel import wrap_ddp

    chunks = build_model(cfg.model, tp=par.tp, pp=par.pp, bf16=cfg.precision == "bf16", seed=cfg.seed)
    model = wrap_ddp(cfg, chunks)
    chunks[0].config.finalize_model_grads_func = finalize_model_grads
    opt = build_optimizer(cfg, model)
    data = SyntheticLoader(cfg.model.resolved().vocab_size, cfg.data.seq_len, cfg.parallel.global_batch_size,
                           cfg.data.seed)
    mbs, s = cfg.parallel.micro_batch_size, cfg.data.seq_len

    def fwd(it, m):
        b = next(it).to(par.device)
        tok, lab = b[:, :-1].contiguous(), b[:, 1:].contiguous()
        pos = torch.arange(s, device=tok.device).expand_as(tok)
        out = m(tok, pos, None, labels=lab)
        return out, lambda o: (o.float().sum(), torch.tensor(o.numel(), dtype=torch.int), {})

    def step():
        batch = next(data)
        for m in model:
            m.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter(batch.split(mbs)), model=model,
                                    num_microbatches=par.num_microbatches, seq_length=s, micro_batch_size=mbs)
        opt.step()
    return step


def timed(fn, n: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) per call."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--run-dir", default="/tmp/bench_trainer")
    ap.add_argument("--append", default=None, help="append a results section to this markdown file")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")

    from train.trainer import Trainer

    cfg = _cfg(args)
    trainer = Trainer(cfg)
    bare = bare_loop(trainer.cfg, trainer.par)
    ours = trainer.train_step
    timed(ours, 2)
    timed(bare, 2)  # warm-up
    a, b = [], []
    for r in range(args.rounds):  # ABBA order, so drifting background load hits both sides alike
        first, second = ((ours, a), (bare, b)) if r % 2 == 0 else ((bare, b), (ours, a))
        first[1].append(timed(first[0], args.steps))
        second[1].append(timed(second[0], args.steps))
    tokens = cfg.parallel.global_batch_size * cfg.data.seq_len
    wa, wb = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
    ca, cb = statistics.median(x[1] for x in a), statistics.median(x[1] for x in b)
    ta, tb = tokens / wa, tokens / wb
    m = cfg.model.resolved()
    shape = (f"{m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_heads}/{m.num_kv_heads}, ffn "
             f"{m.ffn_hidden_size}, vocab {m.vocab_size}, seq {cfg.data.seq_len}, batch {cfg.parallel.global_batch_size}"
             f" (micro {cfg.parallel.micro_batch_size}), {cfg.precision}")
    lines = [f"| path | tokens/s (median of {args.rounds} × {args.steps} steps) | wall ms/step | CPU ms/step |",
             "|---|---|---|---|",
             f"| `train` Trainer.train_step | {ta:,.0f} | {1000 * wa:.0f} | {1000 * ca:.0f} |",
             f"| bare megatron-core loop | {tb:,.0f} | {1000 * wb:.0f} | {1000 * cb:.0f} |",
             "", f"Trainer overhead: {100 * (wa / wb - 1):+.1f} % wall, {100 * (ca / cb - 1):+.1f} % CPU time "
                 "(goal <= 5 %)."]
    print(shape)
    print("\n".join(lines))
    trainer.close()
    if args.append:
        cmd = "python tools/bench/bench_trainer.py " + " ".join(sys.argv[1:])
        section = [
            "", f"## Trainer step vs bare megatron-core loop ({datetime.date.today().isoformat()})", "",
            f"Command: `{cmd}`. Machine: {platform.machine()}, {os.cpu_count()} cores, "
            f"torch {__import__('torch').__version__}, megatron-core {_mcore_version()}, "
            f"{'CUDA' if __import__('torch').cuda.is_available() else 'CPU (gloo, train.model.cpu_compat)'}. "
            f"Model: {shape}. Load average during the run: "
            f"{os.getloadavg()[0]:.1f} (other work shared the cores).", "", *lines, ""]
        with open(args.append, "a") as f:
            f.write("\n".join(section))
    from train.model import parallel

    parallel.shutdown()


def _mcore_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
