"""Training metrics: FLOPs per token and MFU, memory, sinks (console, JSONL, TensorBoard, trackers), alerts.

FLOPs per token (training = forward + backward = 3 × forward, matmuls only, PaLM appendix B convention):
    6 · (L · (attention + MLP matmul params) + V · h)  +  12 · L · s · h_q
(MoE: the MLP term is the router, top_k routed experts and the shared expert: active parameters),
where V · h is the output projection (counted even when tied: the matmul happens), s the sequence
length and h_q = heads · head_dim; the second term is attention's QKᵀ and AV (full, not causal-halved,
as Megatron-LM and PaLM report it).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import psutil

from train.model.gpt import ModelConfig
from train.model.moe import mlp_matmul_params

# Dense bf16 tensor-core peak per GPU (FLOP/s), from NVIDIA's datasheets (SXM parts).
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12}


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    s = m.resolved()
    h, L, f = s.hidden_size, s.num_layers, s.ffn_hidden_size
    hq = s.num_heads * s.kv_channels()
    hkv = s.num_kv_heads * s.kv_channels()
    # MoE (train.model.moe): the MLP a token goes through is the router, top_k experts and the shared expert
    matmul_params = L * (h * hq + 2 * h * hkv + hq * h + mlp_matmul_params(s.moe, h, f)) + s.vocab_size * h
    return 6.0 * matmul_params + 12.0 * L * seq_len * hq


def peak_flops(configured: float | None, precision: str = "bf16") -> float | None:
    """Peak FLOP/s of one device: the configured value, else a datasheet value for the CUDA device."""
    if configured:
        return configured
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16.items():
        if key in name:
            # fp8 is measured against the bf16 peak too (its tensor-core peak is twice that); fp32 runs
            # on TF32 tensor cores: half the bf16 rate
            return value if precision in ("bf16", "fp8") else value / 2
    return None


def mfu(tokens_per_s_per_device: float, fpt: float, peak: float | None) -> float | None:
    return tokens_per_s_per_device * fpt / peak if peak else None


def memory_stats() -> dict:
    """Device memory (CUDA: allocated, reserved, fragmentation, fraction of total) or host RSS on CPU.

    `fraction` is what the memory alert compares: CUDA reserved / total, or RSS / total RAM on CPU."""
    import torch

    rss = psutil.Process().memory_info().rss
    out = {"rss_gib": rss / 2**30}
    from train.model import cpu_compat

    if torch.cuda.is_available() and not cpu_compat.active():
        alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        out.update(alloc_gib=alloc / 2**30, reserved_gib=reserved / 2**30,
                   peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                   fragmentation=(1 - alloc / reserved) if reserved else 0.0, fraction=reserved / total)
    else:
        out["fraction"] = rss / psutil.virtual_memory().total
    return out


class Sinks:
    """Rank 0 writes each record to the console, `metrics.jsonl`, TensorBoard (`tb/`) and the configured
    experiment trackers (train.monitor.trackers: W&B, MLflow, on their own threads)."""

    def __init__(self, run_dir: str | os.PathLike, monitor=None, enabled: bool = True, config: dict | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._jsonl = None
        self._tb = None
        self._trackers = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        history = (self.run_dir / "metrics.jsonl", self._jsonl.tell())  # a resumed run's records so far
        if monitor is not None and monitor.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
            except ImportError:  # tensorboard is a declared dependency; stay usable without it
                self._tb = None
        if monitor is not None and (monitor.wandb.enabled or monitor.mlflow.enabled):
            from train.monitor.trackers import Trackers

            self._trackers = Trackers(monitor, self.run_dir, config or {}, history)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        rec = {"time": time.time(), **rec}
        self._jsonl.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k not in ("step", "time") and v is not None:
                    self._tb.add_scalar(f"train/{k}", v, rec["step"])
        if self._trackers is not None:
            self._trackers.log_train(rec)
        print(format_record(rec), file=sys.stdout, flush=True)
        self._tracker_warnings(rec["step"])

    def log_eval(self, step: int, consumed_tokens: int, metrics: dict) -> None:
        """An evaluation record (`val/<source>/...`, `eval/<task>/...`, `eval_time_s`): JSONL, TensorBoard
        under its own tags, the trackers (the scalars, and the record as an `eval_table`), one console line."""
        if not self.enabled:
            return
        rec = {"time": time.time(), "step": step, "consumed_tokens": consumed_tokens, "kind": "eval", **metrics}
        self._jsonl.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k if "/" in k else f"eval/{k}", v, step)
        if self._trackers is not None:
            self._trackers.log_eval(step, metrics)
        print(format_eval(rec), file=sys.stdout, flush=True)
        self._tracker_warnings(step)

    def event(self, step: int, kind: str, message: str) -> None:
        """Alerts and notable events: console (stderr) and JSONL."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"time": time.time(), "step": step, "event": kind, "message": message}) + "\n")
        print(f"[{kind}] step {step}: {message}", file=sys.stderr, flush=True)

    def _tracker_warnings(self, step: int) -> None:
        for w in self._trackers.warnings() if self._trackers is not None else ():
            self.event(step, "warning", w)

    def close(self, step: int = 0) -> None:
        """Flush and close; the trackers get the run's plots (train plot's PNGs) and finish."""
        if self._trackers is not None:
            try:
                from train.monitor.plot import plot

                png = plot(self.run_dir)
                self._trackers.images([p for p in (png, png.parent / "eval.png") if p.exists()], step)
            except Exception as e:  # noqa: BLE001 - plots are a courtesy to the tracker, never a failure
                self.event(step, "warning", f"no plots for the trackers: {e}")
            self._trackers.close()
            self._tracker_warnings(step)
        if self._jsonl:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def format_record(r: dict) -> str:
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"gnorm {r['grad_norm']:.3f}", f"lr {r['lr']:.2e}",
             f"{r['tokens_per_s']:,.0f} tok/s", f"{r['step_time_s'] * 1000:.0f} ms/step",
             f"data {100 * r['data_wait_share']:.1f}%"]
    if r.get("comm_share") is not None:
        parts.append(f"comm {100 * r['comm_share']:.1f}%")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if r.get("moe_load_imbalance_max") is not None:  # train.monitor.moe
        parts.append("moe" + (f" aux {r['moe_aux_loss']:.3f}" if "moe_aux_loss" in r else "")
                     + (f" z {r['moe_z_loss']:.2f}" if "moe_z_loss" in r else "")
                     + f" imb {r['moe_load_imbalance_max']:.2f}"
                     + (f" idle {r['moe_idle_experts']}" if r.get("moe_idle_experts") else ""))
    mem = r.get("reserved_gib", r.get("rss_gib"))
    parts.append(f"mem {mem:.2f} GiB")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    return " | ".join(parts)


GENERATIVE_HEADLINE = ("exact_match/strict-match", "exact_match/flexible-extract", "prompt_level_strict_acc")


def format_eval(r: dict) -> str:
    parts = [f"eval {r['step']:>6}"]
    if "val/all/loss" in r:
        parts.append(f"val loss {r['val/all/loss']:.4f} ppl {r['val/all/ppl']:.1f} bpb {r['val/all/bpb']:.3f}")
    tasks = sorted({k.split("/")[1] for k in r if k.startswith("eval/") and k.endswith("/acc_norm")})
    parts += [f"{t} {r[f'eval/{t}/acc_norm']:.3f}" for t in tasks]
    for k in sorted(k for k in r if k.startswith("eval/") and k.endswith(GENERATIVE_HEADLINE)):  # generative tasks
        parts.append(f"{k.split('/')[1]} {k.split('/', 2)[2]} {r[k]:.3f}")
    if "rl_val/reward" in r:
        parts.append(f"held-out reward {r['rl_val/reward']:.3f} ± {r['rl_val/reward_se']:.3f} "
                     f"({r['rl_val/prompts']} prompts)")
    if "reward_val/accuracy" in r:
        parts.append(f"held-out pairs {r['reward_val/pairs']}: accuracy {r['reward_val/accuracy']:.3f} ± "
                     f"{r['reward_val/accuracy_se']:.3f}")
    if "dpo_val/pairs" in r:
        parts.append(f"held-out pairs {r['dpo_val/pairs']}: reward acc {r['dpo_val/reward_accuracy']:.3f} margin "
                     f"{r['dpo_val/reward_margin']:+.3f} chosen reward {r['dpo_val/rewards_chosen']:+.3f}")
    parts.append(f"{r['eval_time_s']:.1f} s")
    return " | ".join(parts)


class Alerts:
    """Warnings and the memory stop, checked on every metrics record.

    - MFU: a warning when MFU stays below `mfu_warn_below` for `mfu_window` consecutive records (one noisy
      record does not fire); once per episode: it re-arms after a record at or above the threshold.
      Records without MFU (no peak known) leave the count as it is.
    - Communication: a warning when a record's `comm_share` (a mean over its log window and the ranks) is
      above `comm_share_warn_above`; once per episode, re-armed by a record at or below it. The first
      record of a run (or of a resumed one) is not judged: it holds the warm-up (NCCL communicator set-up
      at the first collective of each group, first-batch work).
    - Memory: the fraction above `memory_stop_above` → a stop reason (the trainer stops cleanly).
    - MoE: a warning when some expert has received no token for `moe_idle_expert_steps` steps in a row
      (`moe_idle_steps_max`, train.monitor.moe); once per episode, re-armed when every expert gets tokens.
    A threshold of 0 turns its alert off."""

    def __init__(self, mfu_warn_below: float, memory_stop_above: float, mfu_window: int = 5,
                 comm_share_warn_above: float = 0.15, moe_idle_expert_steps: int = 0):
        self.mfu_warn_below, self.memory_stop_above = mfu_warn_below, memory_stop_above
        self.mfu_window, self.comm_share_warn_above = max(1, mfu_window), comm_share_warn_above
        self.moe_idle_expert_steps, self._moe_fired = moe_idle_expert_steps, False
        self._mfu_low: list[float] = []   # the last (up to mfu_window) records of the current low run
        self._mfu_fired = False
        self._comm_fired = False
        self._records = 0

    def check(self, rec: dict) -> tuple[list[str], str | None]:
        """(warnings, stop reason or None) for one metrics record."""
        warnings = []
        self._records += 1
        m = rec.get("mfu")
        if self.mfu_warn_below and m is not None:
            if m < self.mfu_warn_below:
                self._mfu_low = (self._mfu_low + [m])[-self.mfu_window:]
                if len(self._mfu_low) == self.mfu_window and not self._mfu_fired:
                    self._mfu_fired = True
                    low = self._mfu_low
                    warnings.append(f"MFU has stayed below {100 * self.mfu_warn_below:.0f}% for {len(low)} "
                                    f"records (mean {100 * sum(low) / len(low):.1f}%, last {100 * m:.1f}%)")
            else:
                self._mfu_low, self._mfu_fired = [], False
        c = rec.get("comm_share")
        if self.comm_share_warn_above and c is not None and self._records > 1:
            if c > self.comm_share_warn_above:
                if not self._comm_fired:
                    self._comm_fired = True
                    warnings.append(f"communication is {100 * c:.1f}% of step time (above "
                                    f"{100 * self.comm_share_warn_above:.0f}%; {_comm_breakdown(rec)})")
            else:
                self._comm_fired = False
        idle = rec.get("moe_idle_steps_max")
        if self.moe_idle_expert_steps > 0 and idle is not None:
            if idle >= self.moe_idle_expert_steps and not self._moe_fired:
                self._moe_fired = True
                warnings.append(f"an expert has received no token for {idle} steps ({rec['moe_idle_experts']} "
                                "(layer, expert) pairs idle in the last window): router collapse?")
            elif idle < self.moe_idle_expert_steps:
                self._moe_fired = False
        stop = None
        if self.memory_stop_above and rec["mem_fraction"] > self.memory_stop_above:
            stop = (f"memory at {100 * rec['mem_fraction']:.1f}% is above "
                    f"{100 * self.memory_stop_above:.0f}%: stopping cleanly")
        return warnings, stop


def _comm_breakdown(rec: dict) -> str:
    from train.monitor.comm import KINDS

    parts = [f"{k} {100 * rec[f'comm_share_{k}']:.1f}%" for k in KINDS if rec.get(f"comm_share_{k}")]
    worst = rec.get("comm_share_max")
    return ", ".join(parts + ([f"worst rank {100 * worst:.1f}%"] if worst is not None else []))
