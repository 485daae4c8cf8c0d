"""The measurements of tools/gpu_check.py, one function per part: `part(ctx, budget_s) -> dict` returns
its results or raises `Skip(reason)`. `ctx` carries the device facts, the work folder and what earlier
parts found (the checkpoint part reads the training runs' final saves).

Also the NCCL worker: `python -m tools.gpu_check_parts nccl-worker SIZE_MIB ITERS OUT.json` (under torchrun).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# preset → (seq_len, micro-batch sizes tried, largest first); 4 micro-batches per step
PRESETS = {"135m": (2048, (8, 4, 2, 1)), "360m": (2048, (8, 4, 2, 1)), "1.7b": (4096, (4, 2, 1))}
MICROBATCHES, STEPS, LOG_EVERY = 4, 10, 5  # the last record covers steps 6-10 (1-5: warm-up)
WEIGHT = {"135m": 1.0, "360m": 1.2, "1.7b": 2.2}  # expected wall time of a run (start-up, steps, final save)


class Skip(Exception):
    """A part that cannot run here; the message says why."""


def recompute_modes() -> list[str]:
    """recompute off, and selective when the model config has `recompute` (train/model/gpt.py)."""
    from train.model.gpt import ModelConfig

    return ["none", "selective"] if "recompute" in {f.name for f in dataclasses.fields(ModelConfig)} else ["none"]


def te_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def train_config(preset: str, recompute: str, mbs: int, root: Path) -> dict:
    """The `train launch` config of one measurement run: bf16, synthetic tokens, one GPU, no evaluation;
    the last step's forced full checkpoint lands in ROOT (the checkpoint part measures it)."""
    seq, _ = PRESETS[preset]
    name = f"{preset}-{recompute}"
    # megatron's own init (on the GPU): the layout-invariant one draws every weight on the host (slow at 1.7b)
    model = {"preset": preset, "init": "megatron", **({"recompute": recompute} if recompute != "none" else {})}
    return {"run_dir": str(root / f"run-{name}"), "steps": STEPS, "seed": 1, "precision": "bf16", "model": model,
            "parallel": {"micro_batch_size": mbs, "global_batch_size": mbs * MICROBATCHES},
            "data": {"seq_len": seq}, "debug": {"synthetic_data": True},
            "optim": {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 2},
            "monitor": {"log_every": LOG_EVERY, "tensorboard": False}, "alerts": {"mfu_warn_below": 0.0},
            "eval": {"every": 0}, "checkpoint": {"full_every": 0, "incremental_every": 0, "keep_last": 1,
                                                 "keep_full_every": 0}}


def predict(cfg_dict: dict, flash: bool) -> dict:
    """`train estimate`'s prediction for a config (world 1, its default MFU)."""
    import copy

    from storage import config as cfgmod
    from train.config import TrainConfig
    from train.monitor.estimate import estimate

    return estimate(cfgmod.from_dict(TrainConfig, copy.deepcopy(cfg_dict)), 1, flash_attention=flash)


def plan(root: Path, gpu_gib: float, flash: bool) -> list[dict]:
    """Every training run: (preset, recompute) with the largest micro-batch whose predicted memory fits
    80 % of the GPU (the same micro-batch for both recompute modes), its config and launch command."""
    runs = []
    for preset, (_, sizes) in PRESETS.items():
        mbs = next((b for b in sizes if predict(train_config(preset, "none", b, root), flash)["memory_total_gib"]
                    <= 0.8 * gpu_gib), sizes[-1])
        for rc in recompute_modes():
            cfg = train_config(preset, rc, mbs, root)
            path = root / f"{preset}-{rc}.yaml"
            runs.append({"name": f"{preset}-{rc}", "preset": preset, "recompute": rc, "mbs": mbs, "config": cfg,
                         "path": path, "cmd": ["launch", str(path), "--nproc", "1"]})
    return runs


def write_configs(runs: list[dict]) -> None:
    import yaml

    for r in runs:
        r["path"].parent.mkdir(parents=True, exist_ok=True)
        r["path"].write_text(yaml.safe_dump(r["config"]))


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> int:
    """Run cmd (own session), output to `log`; on timeout kill its whole group and return 124."""
    with open(log, "a") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                             env={**os.environ, **(env or {})})
        try:
            return p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return 124


def train(ctx: dict, budget: float) -> dict:
    """tokens/s, MFU and peak memory per preset and recompute mode, against `train estimate`."""
    root, flash = ctx["dir"], te_installed()
    runs = plan(root, ctx["gpu_gib"], flash)
    write_configs(runs)
    deadline, rows = time.time() + budget, []
    for i, r in enumerate(runs):
        left = deadline - time.time()
        if left < 30:
            rows.append({"run": r["name"], "skipped": "no time left in the part's budget"})
            continue
        # the time left, shared by the runs still to go in proportion to their expected cost
        share = left * WEIGHT[r["preset"]] / sum(WEIGHT[x["preset"]] for x in runs[i:])
        t0 = time.time()
        rc = run_logged([sys.executable, "-m", "train.cli", *r["cmd"]], root / f"{r['name']}.log", share)
        row = {"run": r["name"], "preset": r["preset"], "recompute": r["recompute"], "micro_batch": r["mbs"],
               "seq_len": r["config"]["data"]["seq_len"], "wall_s": round(time.time() - t0, 1), "exit": rc}
        run_dir = Path(r["config"]["run_dir"])
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
            if (run_dir / "metrics.jsonl").exists() else []
        steps = [x for x in recs if "loss" in x]
        if steps:
            last = steps[-1]
            est = predict(r["config"], flash)
            row.update(step=last["step"], tokens_per_s=last["tokens_per_s"], mfu=last.get("mfu"),
                       peak_alloc_gib=last.get("peak_alloc_gib"), reserved_gib=last.get("reserved_gib"),
                       est_tokens_per_s=est["tokens_per_s"], est_mfu=est["mfu"],
                       est_memory_gib=est["memory_total_gib"])
            row["tokens_vs_est"] = last["tokens_per_s"] / est["tokens_per_s"]
            if last.get("peak_alloc_gib"):
                row["memory_vs_est"] = last["peak_alloc_gib"] / est["memory_total_gib"]
            row["checkpoint"] = final_save(run_dir, last["time"])
        rows.append(row)
        shutil.rmtree(run_dir, ignore_errors=True)  # the 1.7b checkpoints are ~24 GB each
    return {"flash_attention": flash, "runs": rows}


def final_save(run_dir: Path, last_step_time: float) -> dict | None:
    """The last step's forced full checkpoint: bytes, training stall, and when it was committed (the
    commit line's time in rank0.log, after the last step's metrics record)."""
    ckpts = sorted((run_dir / "checkpoints").glob("step_*/manifest.json"))
    if not ckpts:
        return None
    m = json.loads(ckpts[-1].read_text())
    out = {"bytes": m.get("tensor_bytes", {}).get("written"), "stall_s": m.get("stall_s")}
    log = run_dir / "logs" / "rank0.log"
    hits = re.findall(r"^(\S+ \S+),(\d+) INFO train\.checkpoint: checkpoint \S+ \(full\) committed",
                      log.read_text(), re.M) if log.exists() else []
    if hits:
        t = time.mktime(time.strptime(hits[-1][0], "%Y-%m-%d %H:%M:%S")) + int(hits[-1][1]) / 1000
        out["committed_after_s"] = round(t - last_step_time, 2)
        if out["bytes"] and out["committed_after_s"] > 0:
            out["gib_per_s"] = out["bytes"] / 2**30 / out["committed_after_s"]
    return out


def checkpoint(ctx: dict, budget: float) -> dict:
    """A checkpoint save to the work folder (local NVMe): the final full saves of the training runs."""
    rows = [r for r in ctx.get("train", {}).get("runs", []) if r.get("checkpoint")]
    if not rows:
        raise Skip("no training run finished (the save measured is each run's final full checkpoint)")
    from storage.bench.target import mount_of

    mount, fs_type = mount_of(str(ctx["dir"]))
    return {"target": f"{ctx['dir']} ({fs_type} at {mount})", "saves": {r["run"]: r["checkpoint"] for r in rows}}


def make_dataset(root: Path, tokens: int) -> str:
    """A one-source dataset of random documents (uint16 tokens) for the loader parts."""
    import numpy as np

    from storage.dataset import SourceWriter
    from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest

    if (root / "manifest.json").exists():
        return str(root)
    rng, w, n = np.random.default_rng(0), SourceWriter(str(root), "web", "uint16"), 0
    while n < tokens:
        doc = rng.integers(1, 50_000, int(rng.integers(200, 4000)), dtype=np.uint16)
        w.add_document(f"d{n}", np.append(doc, 0))
        n += len(doc) + 1
    info = w.close()
    write_manifest(str(root), Manifest(TokenizerInfo("tokenizer.json", "0" * 64, 50_000, 0, "uint16"),
                                       {"web": info}, [Phase("all", {"web": 1.0}, info.tokens)]))
    return str(root)


def loader_rate(dataset: str, device: str, backend: str, seconds: float, seq_len: int = 2048,
                batch: int = 32) -> dict:
    """Batches of the streaming loader for `seconds` (after the first, which includes start-up)."""
    import torch

    from storage.loader import LoaderConfig, TokenLoader

    loader = TokenLoader(LoaderConfig(dataset=dataset, seq_len=seq_len, device=device, backend=backend), batch)
    try:
        t0 = time.perf_counter()
        first = next(loader)
        start, n, t1 = time.perf_counter() - t0, 0, time.perf_counter()
        while time.perf_counter() - t1 < seconds:
            b = next(loader)
            n += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t1
        return {"device": str(first.device), "first_batch_s": round(start, 3), "batches": n,
                "tokens_per_s": n * batch * (seq_len + 1) / dt, "on_device": b.is_cuda}
    finally:
        loader.close()


def loader_cuda(ctx: dict, budget: float) -> dict:
    """The loader's CUDA path (pinned host buffers + a side stream) against its CPU batches."""
    ds = make_dataset(ctx["dir"] / "loader-ds", ctx.get("loader_tokens", 16 << 20))
    sec = max(1.0, (budget - 10) / 2)
    return {"cpu": loader_rate(ds, "cpu", "python", sec), ctx["device"]: loader_rate(ds, ctx["device"], "python", sec)}


def dali(ctx: dict, budget: float) -> dict:
    """The loader with DALI's reader (backend: dali) delivering batches on the GPU."""
    from storage.loader.dali import dali_available

    if not dali_available():
        raise Skip("NVIDIA DALI is not installed (pip install '.[dali]')")
    ds = make_dataset(ctx["dir"] / "loader-ds", ctx.get("loader_tokens", 16 << 20))
    out = loader_rate(ds, ctx["device"], "dali", max(1.0, budget - 15))
    out["note"] = "DALI reads the shard bytes (CPU reader, device_id None); checksum + LZ4 decode are ours"
    return out


def gds(ctx: dict, budget: float) -> dict:
    """GPUDirect Storage reads through kvikio into device memory (storage.bench.gds)."""
    from storage.bench import gds as g
    from storage.bench.target import mount_of

    mount, fs_type = mount_of(str(ctx["dir"]))
    ok, why = g.probe(fs_type, "local")
    if not ok:
        raise Skip(why)
    path, size = ctx["dir"] / "gds.bin", 1 << 30
    with open(path, "wb") as f:
        for _ in range(size >> 24):
            f.write(os.urandom(1 << 24))
        os.fsync(f.fileno())
    try:
        points = g.gds_read(str(path), size, [1 << 20, 16 << 20], max(1.0, (budget - 15) / 2))
    finally:
        path.unlink(missing_ok=True)
    return {"target": f"{fs_type} at {mount}", "backend": why,
            "points": [{k: p[k] for k in ("io_size", "gib_per_s", "lat_p50_us")} for p in points]}


def nccl_command(n: int, out: Path, size_mib: int = 256, iters: int = 20) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
            "-m", "tools.gpu_check_parts", "nccl-worker", str(size_mib), str(iters), str(out)]


def nccl(ctx: dict, budget: float) -> dict:
    """NCCL all-reduce bus bandwidth over every GPU of this machine (bf16, 256 MiB)."""
    n = ctx["gpus"]
    if n < 2:
        raise Skip(f"{n} GPU: no all-reduce between GPUs to measure")
    out = ctx["dir"] / "nccl.json"
    rc = run_logged(nccl_command(n, out), ctx["dir"] / "nccl.log", budget)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"nccl worker exit {rc} (see {ctx['dir'] / 'nccl.log'})")
    return json.loads(out.read_text())


def nccl_worker(size_mib: int, iters: int, out: str) -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    n = dist.get_world_size()
    x = torch.ones(size_mib << 19, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / iters
    if dist.get_rank() == 0:
        nbytes = x.numel() * x.element_size()
        Path(out).write_text(json.dumps({"gpus": n, "bytes": nbytes, "time_s": dt, "algbw_gib_s": nbytes / dt / 2**30,
                                         "busbw_gib_s": nbytes / dt / 2**30 * 2 * (n - 1) / n}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["nccl-worker"]:
        raise SystemExit(nccl_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    raise SystemExit(f"usage: python -m {__spec__.name} nccl-worker SIZE_MIB ITERS OUT.json")
