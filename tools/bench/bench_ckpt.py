"""Checkpoint benchmark: our saves (train.checkpoint) vs plain megatron dist_checkpointing (torch_dist)
and plain torch.distributed.checkpoint saves of the same state, in one process run.

State: `--size-mb` MiB of fp32 parameters in `--tensors` tensors plus their AdamW moments (3x the bytes),
updated by real AdamW steps on random gradients between saves. Per run (interleaved, median of --runs):
  ours sync full      CheckpointManager(async_save=False, keep_last=1): write + checksums/fsync/rename;
                      a run's first save (a new tensor file) and its third (which overwrites the
                      first's file, kept for reuse when retention deleted it) are reported apart
  ours async full     the time training is blocked (the maybe_save call + the wait in before_update(),
                      called by a training step before its optimizer step: the issue's "blocking time");
                      the slowdown of that step against the median of 3 steps without a save (on 2
                      cores the background copy and write compete with the step for CPU); time until
                      committed
  ours incremental    --steps-between AdamW steps after its base: stall, time, bytes vs full
  megatron torch_dist dist_checkpointing.save (sync), no checksums
  torch DCP           torch.distributed.checkpoint.save of the plain tensors
                      (both peers as ours: first save into a new directory, a later one into a retired
                      checkpoint's directory, overwriting its files; first with first, later with later)
  path seq write      storage.bench LocalEngine sequential write (8 MiB, 1 thread, fsync), buffered and
                      direct (O_DIRECT: the I/O method our full-checkpoint writer uses), one point of
                      each per run, right after that run's saves (paired: this machine drifts)
Appends a section to docs/benchmarks-history.md (unless --no-append).

    python tools/bench/bench_ckpt.py --dir /var/tmp --size-mb 64 --runs 5
"""
from train.model import cpu_compat

cpu_compat.install()  # at import: megatron's async writer re-imports __main__ with spawn

import argparse
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


class ToyState:
    """Parameters + AdamW moments exposed as megatron ShardedTensors (one rank holds everything)."""

    def __init__(self, size_mb: int, tensors: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        per = size_mb * (1 << 20) // 4 // tensors
        self.params = [torch.nn.Parameter(torch.randn(per, generator=g) * 0.02) for _ in range(tensors)]
        self.opt = torch.optim.AdamW(self.params, lr=3e-4, weight_decay=0.1)
        self.gen = g
        self.step(1)

    def step(self, n: int, before_update=None) -> None:
        for _ in range(n):
            for p in self.params:  # stands in for forward/backward
                p.grad = torch.randn(p.shape, generator=self.gen) * 1e-2
            if before_update is not None:
                before_update()
            self.opt.step()

    def tensors(self) -> dict:
        out = {}
        for i, p in enumerate(self.params):
            st = self.opt.state[p]
            out[f"param.{i}"], out[f"exp_avg.{i}"], out[f"exp_avg_sq.{i}"] = p.data, st["exp_avg"], st["exp_avg_sq"]
        return out

    # the TrainState.model interface
    def sharded_state_dict(self):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in self.tensors().items()}

    def load_state_dict(self, sd, strict=True):
        for k, v in self.tensors().items():
            v.copy_(sd[k])


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def one_run(toy: ToyState, root: str, steps_between: int) -> dict:
    from megatron.core import dist_checkpointing

    from train.checkpoint import CheckpointConfig, CheckpointManager
    from train.state import TrainState

    r = {}
    state = TrainState(model=[toy], optimizer=None, scheduler=None, loader=None)
    # ours, sync full, as in a training run with retention (keep_last 1): the first save writes a new
    # file, the third overwrites the first's, which retention kept for reuse (incremental.retire)
    d = tempfile.mkdtemp(dir=root)
    mgr = CheckpointManager(CheckpointConfig(dir="c", full_every=1, incremental_every=0, keep_last=1,
                                             async_save=False), d)
    for step in (1, 2, 3):
        state.step = step
        t = time.perf_counter()
        mgr.maybe_save(state)
        if step == 1:
            r["sync_first_s"] = time.perf_counter() - t
            r["tensor_write_first_s"] = mgr.saver.last_tensor_write[1]
    r["sync_s"] = time.perf_counter() - t
    r["tensor_write_s"] = mgr.saver.last_tensor_write[1]
    mgr.close()
    r["full_bytes"] = dir_bytes(os.path.join(d, "c", "step_00000003"))
    shutil.rmtree(d)
    # ours, async full, then incremental on it; a manager lives as long as a training run, so it is warmed
    # with one save first (its staging buffers are allocated once per run)
    d = tempfile.mkdtemp(dir=root)
    mgr = CheckpointManager(CheckpointConfig(dir="c", full_every=0, incremental_every=1, keep_last=5), d)
    state.step = 100
    mgr.maybe_save(state, force=True)
    mgr.wait()
    state.step = 1
    mgr._base = None  # the measured save is a full one
    plains = []
    for _ in range(3):
        t = time.perf_counter()
        toy.step(1, mgr.before_update)
        plains.append(time.perf_counter() - t)
    plain = statistics.median(plains)
    t = time.perf_counter()
    mgr.maybe_save(state)
    r["async_call_s"] = time.perf_counter() - t
    toy.step(1, mgr.before_update)
    r["async_block_s"] = mgr.saver.last_stall_s  # the call + the wait in before_update
    r["async_slowdown_s"] = time.perf_counter() - t - plain
    r["step_s"] = plain
    mgr.wait()
    r["async_total_s"] = time.perf_counter() - t
    toy.step(steps_between - 1)
    state.step = 2
    t = time.perf_counter()
    mgr.maybe_save(state)
    r["inc_call_s"] = time.perf_counter() - t
    toy.step(1, mgr.before_update)
    r["inc_block_s"] = mgr.saver.last_stall_s
    r["inc_slowdown_s"] = time.perf_counter() - t - plain
    mgr.wait()
    r["inc_total_s"] = time.perf_counter() - t
    mgr.close()
    r["inc_bytes"] = dir_bytes(os.path.join(d, "c", "step_00000002"))
    shutil.rmtree(d)
    # the peers, sync, saved as ours: a run's first save into a new directory, the second into another, the
    # third into the first's directory (their way to reuse a retired checkpoint: megatron logs it as
    # overwriting an incomplete checkpoint, DCP's FileSystemWriter has overwrite=True by default; both
    # truncate and rewrite each file, where ours rewrites the retired tensor file in place); first and third timed
    import torch.distributed.checkpoint as dcp
    logging.getLogger("megatron.core.dist_checkpointing").setLevel(logging.ERROR)
    peers = {"mcore": lambda d: dist_checkpointing.save(toy.sharded_state_dict(), d),
             "dcp": lambda d: dcp.save(dict(toy.tensors()), checkpoint_id=d)}
    for name, save in peers.items():
        a, b = tempfile.mkdtemp(dir=root), tempfile.mkdtemp(dir=root)
        for i, d in enumerate((a, b, a)):
            t = time.perf_counter()
            save(d)
            if i != 1:
                r[f"{name}_{'later' if i else 'first'}_s"] = time.perf_counter() - t
        r[f"{name}_bytes"] = dir_bytes(a)
        shutil.rmtree(a)
        shutil.rmtree(b)
    return r


def seq_write_gib_s(root: str, size: int, duration: float, mode: str) -> float:
    from storage.bench.io import LocalEngine

    eng = LocalEngine(os.path.join(root, "seqwrite.bin"), size)
    try:
        eng.prepare(direct=mode == "direct")
        return eng.seq_write(threads=1, io_size=8 << 20, mode=mode, duration=duration).gib_per_s
    finally:
        eng.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    ap.add_argument("--size-mb", type=int, default=64, help="fp32 parameter MiB (state is 3x with AdamW moments)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps-between", type=int, default=10, help="AdamW steps between the base and the incremental")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    load_before = os.getloadavg()[0]
    toy = ToyState(args.size_mb, args.tensors)
    runs = []
    try:
        state_bytes = sum(v.numel() * 4 for v in toy.tensors().values())
        for i in range(args.runs):
            runs.append(one_run(toy, root, args.steps_between))
            # the path's reference, in the same run as our saves: this machine's write speed drifts by tens
            # of percent between minutes, so an unpaired reference measured once would decide the ratio
            runs[-1]["seq_buffered_gib_s"] = seq_write_gib_s(root, state_bytes, 2.0, "buffered")
            runs[-1]["seq_direct_gib_s"] = seq_write_gib_s(root, state_bytes, 2.0, "direct")
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                           for k, v in runs[-1].items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    gib = 1 << 30
    seq, seq_direct = med["seq_buffered_gib_s"], med["seq_direct_gib_s"]
    paired = statistics.median(r["full_bytes"] / gib / r["sync_s"] / r["seq_direct_gib_s"] for r in runs)
    refs = " ".join(f"{r['seq_direct_gib_s']:.2f}" for r in runs)
    paired_buf = statistics.median(r["full_bytes"] / gib / r["sync_s"] / r["seq_buffered_gib_s"] for r in runs)
    rows = [
        ("ours sync full, a run's first save (new tensor file)", med["sync_first_s"], med["full_bytes"]),
        ("ours sync full, later saves (write+xxh3+fsync+rename; overwrites a retired checkpoint's file)",
         med["sync_s"], med["full_bytes"]),
        ("ours sync full, later saves: the tensor file write alone (rawfile.write_stream, fsync included)",
         med["tensor_write_s"], state_bytes),
        ("ours sync full, first save: the tensor file write alone", med["tensor_write_first_s"], state_bytes),
        ("ours async full: maybe_save call", med["async_call_s"], None),
        ("ours async full: training blocked (call + before_update wait)", med["async_block_s"], None),
        ("ours async full: step slowdown (step with save - median step without)", med["async_slowdown_s"], None),
        ("ours async full: until committed", med["async_total_s"], med["full_bytes"]),
        (f"ours incremental ({args.steps_between} AdamW steps after base): training blocked", med["inc_block_s"], None),
        ("ours incremental: step slowdown", med["inc_slowdown_s"], None),
        ("ours incremental: until committed", med["inc_total_s"], med["inc_bytes"]),
        ("megatron dist_checkpointing torch_dist (sync), a run's first save (new directory)", med["mcore_first_s"],
         med["mcore_bytes"]),
        ("megatron torch_dist, later saves (into a retired checkpoint's directory, files truncated and rewritten)",
         med["mcore_later_s"], med["mcore_bytes"]),
        ("torch.distributed.checkpoint.save (sync), a run's first save (new directory)", med["dcp_first_s"],
         med["dcp_bytes"]),
        ("torch DCP, later saves (into a retired checkpoint's directory, overwrite=True)", med["dcp_later_s"],
         med["dcp_bytes"]),
    ]
    lines = ["| save | median s | bytes | GiB/s |", "|---|---|---|---|"]
    for name, s, b in rows:
        lines.append(f"| {name} | {s:.3f} | {b:,} | {b / gib / s:.3f} |" if b else f"| {name} | {s:.3f} | - | - |")
    ratios = [
        (f"async blocking time / sync save: {med['async_block_s'] / med['sync_s']:.3f} (issue goal <= 0.05); step "
         f"slowdown / sync save: {med['async_slowdown_s'] / med['sync_s']:.3f}; a training step without a save "
         f"takes {med['step_s']:.3f} s"),
        f"incremental bytes / full bytes: {med['inc_bytes'] / med['full_bytes']:.3f}",
        f"incremental time / full async time: {med['inc_total_s'] / med['async_total_s']:.3f}",
        (f"ours sync full / megatron torch_dist time, a run's first save / first save: "
         f"{med['sync_first_s'] / med['mcore_first_s']:.3f}, later / later: {med['sync_s'] / med['mcore_later_s']:.3f}; "
         f"/ torch DCP: first / first {med['sync_first_s'] / med['dcp_first_s']:.3f}, later / later "
         f"{med['sync_s'] / med['dcp_later_s']:.3f}"),
        (f"ours sync write GiB/s / path sequential write, direct like ours ({seq_direct:.3f} GiB/s): "
         f"{med['full_bytes'] / gib / med['sync_s'] / seq_direct:.3f} (issue goal >= 0.8), median of the per-run "
         f"ratios {paired:.3f} (direct reference per run: "
         f"{refs} GiB/s); / buffered ({seq:.3f} GiB/s): "
         f"{med['full_bytes'] / gib / med['sync_s'] / seq:.3f}, per-run median {paired_buf:.3f}; the tensor file write alone / "
         f"buffered: {state_bytes / gib / med['tensor_write_s'] / seq:.3f}, / direct: "
         f"{state_bytes / gib / med['tensor_write_s'] / seq_direct:.3f}; a run's first save (new file) / direct: "
         f"{med['full_bytes'] / gib / med['sync_first_s'] / seq_direct:.3f}, / buffered: "
         f"{med['full_bytes'] / gib / med['sync_first_s'] / seq:.3f}"),
    ]
    notes = [  # what is and is not compared, one sentence per comparison
        "ours / megatron torch_dist and torch DCP: the same tensors from one process, synchronous, each fsyncing "
        "its files, a run's first save (new file or directory) with the peers' first and a later save with a later "
        "one (ours rewrites a retired checkpoint's tensor file in place, the peers truncate and rewrite a retired "
        "checkpoint's files); not compared: ours also checksums every file (XXH3-128) into a manifest, writes with "
        "O_DIRECT and commits the whole checkpoint by one directory rename, where the peers write no checksums and "
        "rename only their metadata file into place.",
        "ours sync write / path sequential write: our save's bytes over its whole time against storage.bench's "
        "sequential write of a file of the same size on the same folder, measured in the same run; not compared: "
        "the reference writes one stream with no checksums, manifest or rename.",
        "async blocking time / sync save, incremental / full: ours against ours (no peer), same state and folder."]
    table = "\n".join(lines + [""] + [f"- {r}" for r in ratios] + ["", "What is and is not compared:"]
                      + [f"- {n}" for n in notes])
    print(table)
    if not args.no_append:
        cmd = "python tools/bench/bench_ckpt.py " + " ".join(sys.argv[1:])
        section = (
            f"\n## Checkpoint save: ours (full, async, incremental) vs megatron torch_dist vs torch DCP "
            f"({time.strftime('%Y-%m-%d')})\n\nCommand: `{cmd}`  \n"
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}; target {args.dir}; 1-min load average {load_before:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after (other work was running).  \n"
            f"State: {args.size_mb} MiB fp32 parameters in {args.tensors} tensors + AdamW exp_avg/exp_avg_sq = "
            f"{state_bytes:,} tensor bytes, one process (world 1, gloo). Medians of {args.runs} interleaved runs; "
            f"path sequential write = one storage.bench seq_write point per run (buffered and direct, 8 MiB, "
            f"1 thread, fsync, a file of the state's size) on the same folder, right after that run's saves.\n\n{table}\n")
        path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "benchmarks-history.md")
        with open(path, "a") as f:
            f.write(section)
        print(f"appended to {os.path.normpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
