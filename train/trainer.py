"""The `Trainer`: parallel setup → model → data → optimizer/schedule → loop with metrics, alerts, checkpoints.

Read `Trainer.__init__` and `Trainer.train_step` top to bottom; each concern lives in its own module
(train.model, train.optim, train.monitor, train.data, train.checkpoint). What differs between objectives
is the `Objective`'s (train.objectives, chosen by the config key `objective`): its loader, rows per micro-batch, the
work before each step, forward and loss, sequences consumed, metrics. Everything a checkpoint needs is
`trainer.state` (train.state.TrainState).
"""
from __future__ import annotations

import contextlib
import math
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from storage import atomic
from storage import config as cfgmod
from train import objectives
from train.config import TrainConfig
from train.data import make_loader
from train.model import parallel
from train.model.docmask import rope_positions
from train.model.gpt import build_model
from train.monitor.comm import CommTimer, window_metrics
from train.monitor.metrics import Alerts, Sinks, flops_per_token, memory_stats, mfu, peak_flops
from train.monitor.moe import MoEStats
from train.optim import LRScheduler, SpikeDetector, build_optimizer, clip_and_step, grad_norm
from train.rampup import BatchSizes
from train.state import TrainState


class TrainingAborted(RuntimeError):
    """Raised on an abort policy (loss spike, too many skipped steps); the CLI exits non-zero."""


class Trainer:
    def __init__(self, cfg: TrainConfig):
        from megatron.core.distributed import finalize_model_grads

        self.cfg = cfg = cfg.resolved_for_data()
        self.par = par = parallel.init(cfg)
        objective = objectives.get(cfg.objective)
        self.run_dir = Path(cfg.run_dir)
        if par.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic.sweep(str(self.run_dir))  # an interrupted run's temporary files: removed and counted
            cfgmod.save(cfg, self.run_dir / "config.yaml")

        chunks = build_model(cfg.model, tp=par.tp, pp=par.pp, bf16=cfg.bf16_weights(), seed=cfg.seed,
                             per_token_loss=objective.per_token_loss, precision=cfg.precision)
        objective.extend_model(cfg, chunks)  # e.g. a reward or value head
        self.model = parallel.wrap_ddp(cfg, chunks)
        # MoE: router losses, tokens per expert, load imbalance per log window (train.monitor.moe)
        self.moe_stats = MoEStats(chunks, cfg.model.moe, cfg.model.resolved().num_layers, par.device) \
            if cfg.model.moe.enabled else None
        tcfg = chunks[0].config
        # The schedule calls these: DP grad all-reduce (or reduce-scatter), tied-embedding and layernorm
        # grad sync across pipeline stages; without them DP and PP ranks silently diverge.
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.no_sync_func = self.model[0].no_sync if len(self.model) == 1 else [m.no_sync for m in self.model]
        self.optimizer = build_optimizer(cfg, self.model)
        self.batches = BatchSizes(cfg.parallel, cfg.data.seq_len, par.dp, par.rank)  # per step (ramp-up)
        self.scheduler = LRScheduler(self.optimizer, cfg.optim, cfg.steps, self.batches)
        self.loader = make_loader(cfg, par, objective.data)
        self.docs = _document_settings(cfg, objective, self.model)
        self.spikes = SpikeDetector(cfg.spike)
        self.sinks = Sinks(self.run_dir, cfg.monitor, enabled=par.rank == 0, config=cfgmod.to_plain(cfg))
        self.objective = objective(cfg, par, self.model, self.sinks)
        self.state = TrainState(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                loader=self.loader, objective=self.objective,
                                extra={"skipped_steps": 0, "nonfinite_steps": 0, "spike_steps": 0,
                                       "consecutive_skips": 0})
        a = cfg.alerts
        self.alerts = Alerts(a.mfu_warn_below, a.memory_stop_above, a.mfu_window, a.comm_share_warn_above,
                             a.moe_idle_expert_steps)
        self.fpt = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = peak_flops(cfg.monitor.peak_flops, cfg.precision)
        self.ckpt = _checkpoint_manager(cfg, self.run_dir)
        self.evaluator = _evaluator(cfg, self.model, par, self.sinks) if cfg.eval.every else None
        self.stop_reason: str | None = None
        # Time in collectives during train_step (train.monitor.comm): DP grad sync, TP exchanges, PP send/recv.
        self.comm = CommTimer() if cfg.monitor.comm_share else None
        if self.comm is not None:
            self.comm.install()

    def _measuring(self):
        """Count communication during the training step (with debug.comm_delay_s from its step on)."""
        if self.comm is None:
            return contextlib.nullcontext()
        d = self.cfg.debug
        return self.comm.measuring(d.comm_delay_s if self.state.step + 1 >= d.comm_delay_from_step else 0.0)

    def _not_measured(self):
        """The monitoring's own reductions (and checkpoint waits) are not training communication."""
        return self.comm.paused() if self.comm is not None else contextlib.nullcontext()

    # ---------------------------------------------------------------- one step
    def _forward_step(self, data_iterator, model):
        rows = next(data_iterator).to(self.par.device, non_blocking=True)
        out, loss_func = self.objective.forward(model, rows, self.docs, self._rope)
        return out, partial(self._loss, loss_func, self.state.step)

    def _loss(self, loss_func, step: int, output):
        """The objective's (loss sum, count, report) in megatron's loss-function form. For pretraining
        megatron divides the loss by tokens and micro-batches; for per-token objectives it keeps sums and
        divides the gradients by the step's global count."""
        total, n, report = loss_func(output)
        d = self.cfg.debug
        if step in (d.inject_nan_step, d.inject_spike_step):  # tests of the skip and spike paths
            if step == d.inject_nan_step:
                total = total * float("nan")
            if step == d.inject_spike_step:
                total = total * 100.0
            report = torch.cat([total.detach().double().reshape(1), report[1:]])
        return total, n, {"lm_loss": report}

    def train_step(self) -> dict:
        with self._measuring():
            return self._train_step()

    def _train_step(self) -> dict:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg, st = self.cfg, self.state
        gbs = self.batches.at(st.consumed_tokens // cfg.data.seq_len)  # this step's global batch
        t0 = time.perf_counter()
        # this rank's rows: [rows, seq_len + 1], or [rows, 4|5, seq_len] (train.model.docmask)
        batch = self.batches.take(self.loader, gbs)
        data_wait = time.perf_counter() - t0
        mbs = self.objective.rows_per_micro()
        batch = self.objective.before_step(batch)
        micro = batch.split(mbs)

        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.scheduler.apply(gbs)
        with rope_positions(self.model) as self._rope:
            reports = get_forward_backward_func()(
                forward_step_func=self._forward_step, data_iterator=iter(micro), model=self.model,
                num_microbatches=len(micro), seq_length=self.docs_seq_len(mbs, batch),
                micro_batch_size=1 if self.docs["varlen"] else mbs, forward_only=False)
        with self._not_measured():
            report = self._global_report(reports)
        loss = float(report[0] / report[1]) if report[1] > 0 else float("nan")
        loss_tokens, nonpad = int(report[1]), int(report[2])
        norm = grad_norm(self.optimizer)

        skip = None
        if not (math.isfinite(loss) and math.isfinite(norm)):
            skip = "nonfinite"
        elif self.spikes.is_spike(loss):
            z = self.spikes.zscore(loss)
            self.sinks.event(st.step, "spike", f"loss {loss:.4f} z-score {z:.1f} (policy {cfg.spike.policy})")
            if cfg.spike.policy == "abort":
                raise TrainingAborted(f"loss spike at step {st.step}: loss {loss:.4f}, z-score {z:.1f}")
            if cfg.spike.policy == "skip":
                skip = "spike"
        if skip is None:
            if self.ckpt is not None:
                with self._not_measured():
                    self.ckpt.before_update()  # an async save's host copy must finish before the state changes
            clip_and_step(self.optimizer, norm, cfg.optim.clip_grad)
            self.scheduler.step(gbs)
            self.spikes.accept(loss)
            st.extra["consecutive_skips"] = 0
        else:
            self._count_skip(skip, loss, norm)

        st.step += 1
        sequences = self.objective.sequences(gbs)
        st.consumed_tokens += sequences * cfg.data.seq_len
        return {"loss": loss, "grad_norm": norm, "lr": lr, "skipped": skip is not None, "global_batch_size": gbs,
                "sequences": sequences,
                "step_time_s": time.perf_counter() - t0, "data_wait_s": data_wait, "loss_tokens": loss_tokens,
                "nonpad_tokens": nonpad, "width": batch.shape[-1], **self.objective.record(report)}

    def docs_seq_len(self, mbs: int, batch: torch.Tensor) -> int:
        """The sequence length the pipeline schedule sends between stages: the model's input width (a
        pretraining row of n tokens gives n - 1 inputs); thd lays a micro-batch's rows end to end as one
        sequence, of batch size 1."""
        seq = batch.shape[-1] - (1 if batch.dim() == 2 else 0)
        return seq * mbs if self.docs["varlen"] else seq

    def _global_report(self, reports: list) -> torch.Tensor:
        """The micro-batch reports summed over the global batch: (loss sum, loss tokens or pairs, non-padding
        tokens, objective metrics...), known on every rank (decisions must agree)."""
        t = torch.zeros(3 + len(self.objective.report_fields), dtype=torch.float64, device=self.par.device)
        if self.par.is_last_stage and self.par.tp_rank == 0:
            for r in reports:
                t += r["lm_loss"].to(t)
        dist.all_reduce(t)
        return t

    def _count_skip(self, kind: str, loss: float, norm: float) -> None:
        ex = self.state.extra
        ex["skipped_steps"] += 1
        ex["nonfinite_steps" if kind == "nonfinite" else "spike_steps"] += 1
        ex["consecutive_skips"] += 1
        self.sinks.event(self.state.step, "skip", f"{kind} step skipped (loss {loss}, grad norm {norm}); "
                                                  f"{ex['skipped_steps']} skipped so far")
        if ex["consecutive_skips"] >= self.cfg.alerts.max_consecutive_skips:
            raise TrainingAborted(f"{ex['consecutive_skips']} consecutive steps skipped")

    # ---------------------------------------------------------------- loop
    def train(self) -> dict:
        cfg, st = self.cfg, self.state
        if self.ckpt is not None and self.ckpt.resume(st):
            self.spikes.load_state_dict(st.extra.get("spike", {}))
            self.sinks.event(st.step, "resume", f"resumed at step {st.step}")
        elif cfg.init and cfg.init_keep_optimizer:  # a new stage keeping the optimizer state (resume wins)
            from train.checkpoint.resume import load_model_and_optimizer

            load_model_and_optimizer(st, cfg.init, cfg.checkpoint.distrib_optim_sharding_type)
            self.sinks.event(st.step, "init", f"weights and optimizer state from {cfg.init} (fresh schedule, "
                                              "data, step 0)")
        elif cfg.init:  # weights only, and only when there is nothing to resume (resume wins)
            from train.checkpoint.init_from import load_weights

            load_weights(self.model, self.optimizer, cfg.init, fresh=self.objective.fresh_keys)
            self.sinks.event(st.step, "init", f"weights from {cfg.init} (fresh optimizer, schedule, data)")
        self.objective.prepare(st.step)
        window, last = [], {}
        try:
            while st.step < cfg.steps:
                out = self.train_step()
                window.append(out)
                st.extra["spike"] = self.spikes.state_dict()
                if st.step % cfg.monitor.log_every == 0 or st.step == cfg.steps:
                    last = self._log(window)
                    window = []
                if self.evaluator is not None and (st.step % cfg.eval.every == 0 or st.step == cfg.steps):
                    t_eval = time.perf_counter()
                    metrics, _ = self.evaluator.run()  # its wall time is logged apart from tokens/s and MFU
                    metrics |= self.objective.evaluate()
                    metrics["eval_time_s"] = time.perf_counter() - t_eval
                    self.sinks.log_eval(st.step, st.consumed_tokens, metrics)
                if cfg.stop_at is not None and st.step >= cfg.stop_at and not self.stop_reason:
                    self.stop_reason = f"stop_at {cfg.stop_at} reached"
                if self.ckpt is not None:  # the last step and a clean stop always leave a checkpoint
                    self.ckpt.maybe_save(st, force=self.stop_reason is not None or st.step == cfg.steps)
                if self.stop_reason:
                    break
        finally:
            self.close()
        return {"step": st.step, "stop_reason": self.stop_reason, **st.extra, "last": last}

    def _log(self, window: list[dict]) -> dict:
        cfg, par, st = self.cfg, self.par, self.state
        elapsed = sum(w["step_time_s"] for w in window)
        tokens = sum(w["sequences"] for w in window) * cfg.data.seq_len  # each step's own batch (ramp-up)
        tps = tokens / elapsed if elapsed > 0 else 0.0
        mem = memory_stats()
        mem["fraction"] = parallel.all_reduce_max(mem["fraction"], par.device)
        # time blocked in collectives / step time over this window: mean and worst over ranks, and by kind
        comm = window_metrics(self.comm.collect(), elapsed, par.device) if self.comm is not None else {}
        moe = self.moe_stats.collect(len(window)) if self.moe_stats is not None else {}
        rec = {"step": st.step, "loss": window[-1]["loss"], "grad_norm": window[-1]["grad_norm"],
               "lr": window[-1]["lr"], "global_batch_size": window[-1]["global_batch_size"], "tokens_per_s": tps,
               "tokens_per_s_per_device": tps / par.world, "step_time_s": elapsed / len(window),
               "data_wait_share": sum(w["data_wait_s"] for w in window) / elapsed if elapsed > 0 else 0.0,
               "mfu": mfu(tps / par.world, self.fpt, self.peak), "consumed_tokens": st.consumed_tokens,
               "skipped_steps": st.extra["skipped_steps"], "nonfinite_steps": st.extra["nonfinite_steps"],
               "spike_steps": st.extra["spike_steps"], "mem_fraction": mem.pop("fraction"), **comm, **mem, **moe,
               **self.objective.log_fields(window, tokens, elapsed)}
        self.sinks.log(rec)
        warnings, stop = self.alerts.check(rec)
        for w in warnings:
            self.sinks.event(st.step, "warning", w)
        if stop:
            self.sinks.event(st.step, "stop", stop)
            self.stop_reason = stop
        return rec

    def close(self) -> None:
        if self.comm is not None:
            self.comm.uninstall()
            self.comm = None
        if self.ckpt is not None:
            self.ckpt.wait()
            self.ckpt.close()
            self.ckpt = None
        self.objective.close()
        self.loader.close()
        self.sinks.close(self.state.step)


def _document_settings(cfg: TrainConfig, objective, model: list) -> dict:
    """micro_batch's settings: document masking, the EOS that ends documents in token-stream rows, and
    whether attention takes packed sequences (Transformer Engine's thd format) instead of an explicit mask."""
    eos = None
    if cfg.document_masking() and objective.data == "tokens":
        from storage.manifest import read_manifest

        eos = read_manifest(cfg.data.dataset).tokenizer.eos_id
    from train.eval.scorer import supports_trees

    return {"document_masking": cfg.document_masking(), "eos_id": eos,
            "varlen": cfg.document_masking() and not supports_trees(model)}


def _checkpoint_manager(cfg: TrainConfig, run_dir: Path):
    """train.checkpoint's manager; the manifest records the resolved model config (for HF export)."""
    from train.checkpoint import CheckpointManager
    from train.checkpoint.init_from import stage_history

    # precision of the stored weights (fp8 trains bf16 weights): what init, eval and merge read; optimizer:
    # its kind (what --keep-optimizer checks); stages: the history of the chain of runs this one ends
    p = cfg.parallel
    meta = {"model": cfgmod.to_plain(cfg.model.resolved()), "precision": "bf16" if cfg.bf16_weights() else "fp32",
            "seq_len": cfg.data.seq_len, "padded_vocab_size": cfg.model.padded_vocab_size(cfg.parallel.tp),
            "optimizer": {"distributed": p.distributed_optimizer, "sharding_type":
                          cfg.checkpoint.distrib_optim_sharding_type if p.distributed_optimizer else None},
            "stages": stage_history(cfg)}
    if cfg.data.dataset and not cfg.debug.synthetic_data:  # lets `train ckpt export` ship the tokenizer
        from storage import fs
        from storage.manifest import read_manifest

        meta["tokenizer"] = fs.join(cfg.data.dataset, read_manifest(cfg.data.dataset).tokenizer.file)
    return CheckpointManager(cfg.checkpoint, str(run_dir), meta=meta)


def _evaluator(cfg: TrainConfig, model: list, par, sinks: Sinks):
    """train.eval's evaluator on the training model; the dataset's tokenizer scores the benchmarks."""
    from train.eval.evaluator import build_evaluator

    dataset = None if cfg.debug.synthetic_data else cfg.data.dataset
    tok = None
    if dataset:
        from storage import fs
        from storage.manifest import read_manifest

        tok = fs.join(dataset, read_manifest(dataset).tokenizer.file)
    return build_evaluator(cfg, model, par, tok, dataset, warn=lambda msg: sinks.event(0, "warning", msg))


def run(cfg: TrainConfig) -> int:
    """Train in this (torchrun-started) process; 0 on completion or a clean stop, 3 on an abort."""
    import sys

    trainer = None
    try:
        trainer = Trainer(cfg)
        result = trainer.train()
        if trainer.par.rank == 0:
            print(f"done: step {result['step']}, skipped {result['skipped_steps']}"
                  + (f", stopped: {result['stop_reason']}" if result["stop_reason"] else ""), flush=True)
        return 0
    except TrainingAborted as e:
        print(f"aborted: {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        parallel.shutdown()
