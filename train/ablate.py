"""`train ablate ABLATION.yaml`: run a data ablation, the Smol Training Playbook's method for every data choice.

Each variant is built by `datapipe build` from one build config with its overrides (OUTPUT/data/VARIANT; the
baseline first, and every other build on the baseline's tokenizer unless the config fixes one), each
validation set given as a build config likewise (OUTPUT/validation/NAME); then one `train launch` per
(variant, seed) with equal steps, hence equal tokens (OUTPUT/runs/VARIANT/seedS), then `train eval` of each
final checkpoint on every validation set's held-out split and the tasks (OUTPUT/eval/SET/PART/LABEL.json),
merged per run (OUTPUT/results/LABEL.json) and reported by train.ablate_report. Everything runs as
subprocesses of the `datapipe` and `train` commands (train never imports datapipe).

Resumable: a finished build (its manifest), run (a checkpoint at the last step) or evaluation (its result
file) is skipped; a killed run resumes from its newest checkpoint through the trainer's own resume. The
settings each output was made with are kept in OUTPUT/state.json: a changed build or training setup is
refused rather than mixed in; changed evaluation settings re-evaluate. `--slurm` runs the builds here and
each run as one task of an sbatch array (OUTPUT/slurm/), the report as a job after the array.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from storage import atomic
from storage import config as cfgmod
from storage.config import ConfigError
from train.ablate_config import AblationConfig
from train.config import TrainConfig


class AblationError(RuntimeError):
    """A build, run or evaluation that failed, or a dataset refused: one line naming it."""


@dataclass(frozen=True)
class Run:
    variant: str
    seed: int

    @property
    def label(self) -> str:
        return f"{self.variant}.s{self.seed}"


@dataclass
class Group:
    """One `train eval` pass per run: a validation set's held-out split (and the tasks, on the first)."""
    name: str
    dataset: str
    validation_tokens: int
    tasks: list[str]


def _sets(overrides: dict) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def _fp(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


class Ablation:
    def __init__(self, cfg: AblationConfig, echo: Callable[[str], None] = print):
        from train import objectives

        self.cfg, self.echo, self.out = cfg, echo, Path(cfg.output)
        self.baseline = cfg.baseline_name
        self.variants = [self.baseline] + [v for v in cfg.variants if v != self.baseline]
        self.runs = [Run(v, s) for v in self.variants for s in cfg.seeds]
        self.train_sets = _sets(cfg.train_overrides)
        try:
            t = self.tcfg = cfgmod.load(TrainConfig, cfg.train, self.train_sets)
        except ConfigError as e:
            raise ConfigError(f"key 'train': {e}") from None
        if objectives.get(t.objective).data != "tokens":
            raise ConfigError(f"key 'train': objective {t.objective!r} does not read a token stream (pretraining)")
        if t.parallel.batch_rampup is not None:
            raise ConfigError("key 'train': parallel.batch_rampup: ramped batches make tokens per step vary; "
                              "an ablation's runs take steps × global_batch_size × seq_len tokens")
        if os.path.isabs(t.checkpoint.dir):
            raise ConfigError(f"key 'train': checkpoint.dir {t.checkpoint.dir!r} must be relative (one per run)")
        self.seq_len, self.batch = t.data.seq_len, t.parallel.global_batch_size
        self.steps = cfg.tokens // (self.batch * self.seq_len)
        if self.steps < 1:
            raise ConfigError(f"key 'tokens': {cfg.tokens:,} is less than one step (global_batch_size {self.batch} × "
                              f"seq_len {self.seq_len})")
        self.run_tokens = self.steps * self.batch * self.seq_len
        self.stale: set[str] = set()  # groups whose results were made with other settings (--dry-run)
        self._nproc: int | None = None

    # --- where things go -------------------------------------------------------------------------------
    def data_dir(self, variant: str) -> Path:
        return self.out / "data" / variant

    def val_dir(self, name: str) -> Path:
        path = self.cfg.validation[name]
        return self.out / "validation" / name if os.path.isfile(path) else Path(path)

    def run_dir(self, run: Run) -> Path:
        return self.out / "runs" / run.variant / f"seed{run.seed}"

    def groups(self) -> list[Group]:
        gs = [Group(n, str(self.val_dir(n)), self.cfg.validation_tokens, []) for n in self.cfg.validation]
        if self.cfg.tasks and gs:
            gs[0].tasks = list(self.cfg.tasks)
        elif self.cfg.tasks:
            gs = [Group("tasks", str(self.data_dir(self.baseline)), 0, list(self.cfg.tasks))]
        return gs

    def header(self) -> list[str]:
        return [f"# Ablation {self.out}", "",
                f"Baseline `{self.baseline}`; seeds {', '.join(map(str, self.cfg.seeds))}; every run "
                f"{self.run_tokens:,} tokens ({self.steps} steps × {self.batch} sequences × {self.seq_len} tokens) "
                f"of `{self.cfg.train}`; variants of `{self.cfg.build}`."]

    # --- state: the settings every output was made with -------------------------------------------------
    def state(self) -> dict:
        p = self.out / "state.json"
        return json.loads(p.read_text()) if p.is_file() else {}

    def save_state(self, st: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(str(self.out / "state.json"), json.dumps(st, indent=1, sort_keys=True).encode())

    def train_fp(self) -> str:
        """The resolved train config but its `launch` section (how runs start, not what they compute)."""
        plain = cfgmod.to_plain(self.tcfg)
        plain.pop("launch")
        return _fp({"train": plain, "steps": self.steps})

    def eval_fp(self, g: Group) -> str:
        return _fp({"dataset": g.dataset, "tokens": g.validation_tokens, "tasks": g.tasks,
                    "limit": self.cfg.limit if g.tasks else None})

    def check_train_fp(self, st: dict) -> None:
        old = st.get("train")
        if old and old != self.train_fp() and any(self.run_step(r) is not None for r in self.runs):
            raise AblationError(f"the training setup ({self.cfg.train}, train_overrides, tokens) changed since the "
                                f"runs under {self.out / 'runs'} started: give another output, or delete "
                                f"{self.out / 'runs'}, {self.out / 'eval'} and {self.out / 'results'}")

    # --- builds ------------------------------------------------------------------------------------------
    def build_specs(self) -> list[tuple[str, str, str, Path, list[str]]]:
        """(kind, name, build config, output folder, --set overrides), the baseline first."""
        def tokenizer_of(raw: dict, overrides: dict) -> str | None:
            if "tokenizer.path" in overrides:
                return overrides["tokenizer.path"]
            if isinstance(overrides.get("tokenizer"), dict):
                return overrides["tokenizer"].get("path")
            return (raw.get("tokenizer") or {}).get("path")

        def spec(kind: str, name: str, config: str, out: Path, overrides: dict) -> tuple:
            raw = cfgmod.load_yaml(config)
            sets = _sets(overrides) + [f"output={json.dumps(str(out))}"]
            if raw.get("work_dir"):
                sets.append(f"work_dir={json.dumps(os.path.join(raw['work_dir'], kind, name))}")
            if name != self.baseline or kind != "variant":
                if tokenizer_of(raw, overrides) is None:
                    sets.append(f"tokenizer.path={json.dumps(shared)}")
            return kind, name, config, out, sets

        base_raw = cfgmod.load_yaml(self.cfg.build)
        shared = tokenizer_of(base_raw, self.cfg.variants[self.baseline]) or str(
            self.data_dir(self.baseline) / "tokenizer.json")
        out = [spec("variant", v, self.cfg.build, self.data_dir(v), self.cfg.variants[v]) for v in self.variants]
        return out + [spec("validation", n, p, self.val_dir(n), {}) for n, p in self.cfg.validation.items()
                      if os.path.isfile(p)]

    def builds(self, dry: bool) -> None:
        st = self.state()
        for kind, name, config, out, sets in self.build_specs():
            key, fp = f"{kind}:{name}", _fp({"config": Path(config).read_text(), "sets": sets})
            old = st.setdefault("build", {}).get(key)
            if old is not None and old != fp:
                raise AblationError(f"{kind} {name!r}: its build ({config} with its overrides) changed since {out} "
                                    f"was built: delete {out} (and the runs on it) to rebuild it, or give another output")
            if (out / "manifest.json").is_file():
                self.echo(f"[ablate] {kind} {name}: built ({out})")
            elif dry:
                self.echo(f"[ablate] {kind} {name}: would build {out} from {config} " + " ".join(
                    f"--set {s}" for s in sets))
                continue
            else:
                st["build"][key] = fp
                self.save_state(st)  # before the build: an interrupted one resumes only with the same settings
                cmd = [sys.executable, "-m", "datapipe.cli", "build", config, "--wait", "--quiet"]
                for s in sets:
                    cmd += ["--set", s]
                self.echo(f"[ablate] {kind} {name}: building {out}")
                self.call(cmd, self.out / "logs" / f"build-{kind}-{name}.log", f"datapipe build of {kind} {name!r}")
                if not (out / "manifest.json").is_file():
                    raise AblationError(f"datapipe build of {kind} {name!r} ended without {out}/manifest.json")
            if old is None:
                st["build"][key] = fp
                self.save_state(st)

    def check_datasets(self) -> None:
        """Every built variant and validation set on the baseline's tokenizer; every variant holds the run's
        tokens without repeating a source; every validation set has a held-out split."""
        from storage.manifest import read_manifest

        if not (self.data_dir(self.baseline) / "manifest.json").is_file():
            return
        sha = read_manifest(str(self.data_dir(self.baseline))).tokenizer.sha256
        sets = [("variant", v, self.data_dir(v)) for v in self.variants]
        for kind, name, path in sets + [("validation", n, self.val_dir(n)) for n in self.cfg.validation]:
            if not (path / "manifest.json").is_file():
                continue
            man = read_manifest(str(path))
            if man.tokenizer.sha256 != sha:
                raise AblationError(f"{kind} {name!r}: {path}'s tokenizer (sha256 {man.tokenizer.sha256[:12]}…) is not "
                                    f"the baseline's ({sha[:12]}…): every variant and validation set must share one "
                                    "tokenizer (leave tokenizer.path unset to use the baseline's, or set it alike)")
            if kind == "variant":
                self.check_tokens(name, man)
            elif not man.validation:
                raise AblationError(f"validation {name!r}: {path} has no held-out split (build it with "
                                    "validation.fraction > 0)")

    def check_tokens(self, variant: str, man) -> None:
        """Refuse a variant one of whose sources a run would read more than once (no silent repetition):
        the sequences each source gives per pass, ⌊(tokens − 1) / seq_len⌋, against those the run draws
        from it under the mix (the train config's data.mix, else the dataset's phases)."""
        from storage.manifest import Phase

        mix = self.tcfg.data.mix
        phases = [Phase("mix", dict(mix), 1)] if mix else man.mix
        need, start, draws = self.steps * self.batch, 0, {}
        for i, ph in enumerate(phases):
            n = need - start if i == len(phases) - 1 else min(need - start, -(-ph.tokens // self.seq_len))
            total = sum(ph.weights.values())
            for s, w in ph.weights.items():
                draws[s] = draws.get(s, 0) + math.ceil(n * w / total)
            start += n
        for s, d in draws.items():
            have = max(0, (man.sources[s].tokens - 1) // self.seq_len) if s in man.sources else 0
            if d > have:
                raise AblationError(
                    f"variant {variant!r}: source {s!r} holds {have:,} training sequences of {self.seq_len} tokens, a "
                    f"run draws {d:,} of them ({self.run_tokens:,} tokens: {self.steps} steps × {self.batch} × "
                    f"{self.seq_len}): it would repeat data; build more, or lower tokens")

    # --- runs and evaluations ----------------------------------------------------------------------------
    def run_step(self, run: Run) -> int | None:
        """The step of the run's newest committed checkpoint (None: none yet)."""
        import fsspec

        from train.checkpoint import layout

        infos = layout.list_checkpoints(fsspec.filesystem("file"), str(self.run_dir(run) / self.tcfg.checkpoint.dir))
        return infos[-1].step if infos else None

    def train_cmd(self, run: Run) -> list[str]:
        sets = [*self.train_sets, f"run_dir={json.dumps(str(self.run_dir(run)))}",
                f"data.dataset={json.dumps(str(self.data_dir(run.variant)))}", f"seed={run.seed}",
                f"data.seed={run.seed}", f"steps={self.steps}", "stop_at=null"]
        cmd = [sys.executable, "-m", "train.cli", "launch", self.cfg.train]
        for s in sets:
            cmd += ["--set", s]
        return cmd + ["--nproc", str(self.nproc())]

    def nproc(self) -> int:
        """Processes per run: `nproc`, else the train config's launch.nproc, else this machine's GPUs or 1
        (found once here rather than by every `train launch`)."""
        if self._nproc is None:
            from train.launch import default_nproc

            self._nproc = self.cfg.nproc or self.tcfg.launch.nproc or default_nproc()
        return self._nproc

    def result(self, g: Group, run: Run) -> dict | None:
        """The run's final checkpoint's `train eval` record for `g` (None: not evaluated yet)."""
        recs = []
        if g.name in self.stale:
            return None
        for p in (self.out / "eval" / g.name).glob(f"*/{run.label}.json"):
            rec = json.loads(p.read_text())
            if rec.get("step") == self.steps:
                recs.append(rec)
        return max(recs, key=lambda r: r.get("evaluated_at", 0.0)) if recs else None

    def eval_cmd(self, g: Group, runs: list[Run]) -> list[str]:
        """`train eval` of `runs` on `g` (`--tasks ,`: no task; without --tasks it would take the early-signal set)."""
        cmd = [sys.executable, "-m", "train.cli", "eval", *[f"{r.label}={self.run_dir(r)}" for r in runs],
               "--out", str(self.out / "eval" / g.name / runs[0].label), "--validation-tokens",
               str(g.validation_tokens), "--tasks", ",".join(g.tasks) or ",", "--nproc", str(self.cfg.nproc or 1),
               "--set", f"data.dataset={json.dumps(g.dataset)}"]
        return cmd + (["--limit", str(self.cfg.limit)] if g.tasks and self.cfg.limit else [])

    def check_eval_fps(self, st: dict, dry: bool) -> None:
        """Evaluations made with other settings (set, tokens, tasks, limit) are dropped, to be made again."""
        for g in self.groups():
            old = st.setdefault("eval", {}).get(g.name)
            if old is not None and old != self.eval_fp(g) and dry:
                self.stale.add(g.name)
            elif old != self.eval_fp(g) and not dry:
                if old is not None:
                    self.echo(f"[ablate] evaluation settings of {g.name} changed: evaluating every run again")
                    shutil.rmtree(self.out / "eval" / g.name, ignore_errors=True)
                st["eval"][g.name] = self.eval_fp(g)
                self.save_state(st)

    def merge(self, run: Run) -> dict | None:
        """OUTPUT/results/LABEL.json: the run's metrics from every group (None until all are evaluated);
        validation keys renamed val/SET/... (val/SET/SOURCE/... when the set has several sources)."""
        metrics: dict[str, float] = {}
        first = None
        for g in self.groups():
            rec = self.result(g, run)
            if rec is None:
                return None
            first = first or rec
            if rec.get("consumed_tokens") != self.run_tokens:
                raise AblationError(f"run {run.label}: its checkpoint consumed {rec.get('consumed_tokens')} tokens, "
                                    f"not the {self.run_tokens:,} of every run")
            srcs = {k.split("/")[1] for k in rec["metrics"] if k.startswith("val/")} - {"all"}
            for k, v in rec["metrics"].items():
                parts = k.split("/")
                if k.startswith("val/") and len(parts) == 3 and parts[2] != "tokens":
                    if parts[1] == "all" or len(srcs) > 1:
                        metrics["/".join(["val", g.name, *([] if parts[1] == "all" else [parts[1]]), parts[2]])] = v
                elif k.startswith("eval/"):
                    metrics[k] = v
        out = {"variant": run.variant, "seed": run.seed, "label": run.label, "run_dir": str(self.run_dir(run)),
               "checkpoint": first["path"] if first else None, "step": self.steps, "tokens": self.run_tokens,
               "metrics": metrics}
        path = self.out / "results" / f"{run.label}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(str(path), json.dumps(out, indent=1).encode())
        return out

    def call(self, cmd: list[str], log: Path, what: str, threads: int = 0) -> None:
        """Run `cmd` with its output appended to `log`; a failure raises one line: what, the log's last line."""
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if threads:
            env.setdefault("OMP_NUM_THREADS", str(threads))
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if rc:
            last = next((ln for ln in reversed(log.read_text().splitlines()) if ln.strip()), "")
            raise AblationError(f"{what} failed (exit status {rc}): {last.strip()} (log: {log})")

    def train_one(self, run: Run, threads: int = 0) -> None:
        step = self.run_step(run)
        self.echo(f"[ablate] run {run.label}: training {self.steps} steps" + (f" (resuming at step {step})" if step
                                                                                else ""))
        self.call(self.train_cmd(run), self.out / "logs" / f"train-{run.label}.log", f"run {run.label}", threads)
        if self.run_step(run) != self.steps:
            raise AblationError(f"run {run.label}: train launch ended before step {self.steps} (log: "
                                f"{self.out / 'logs' / f'train-{run.label}.log'})")

    def eval_some(self, g: Group, runs: list[Run], threads: int = 0) -> None:
        self.echo(f"[ablate] evaluating {', '.join(r.label for r in runs)} on {g.name}")
        self.call(self.eval_cmd(g, runs), self.out / "logs" / f"eval-{g.name}-{runs[0].label}.log",
                  f"evaluation of {', '.join(r.label for r in runs)} on {g.name}", threads)
