"""`TrainConfig`: the typed `train launch` config, validated before any process starts.

Sections: model (train.model.gpt.ModelConfig), parallel, data (storage.loader's LoaderConfig), optim, spike, monitor,
alerts, launch (torchrun / Slurm), checkpoint (train.checkpoint CheckpointConfig), eval (train.eval.config), debug.
Errors name the key (`parallel.tp`, `data.seq_len`, ...). Checks that need the world size
(world = TP × PP × DP, batch divisibility: `check_layout`; plus the fp8 hardware check: `check_world`) run
in `train launch` before torchrun.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from storage.config import ConfigError
from storage.loader.config import LoaderConfig
from train import objectives
from train.checkpoint.config import CheckpointConfig
from train.eval.config import EvalConfig
from train.model.gpt import ModelConfig
from train.model.moe import layout_problem
from train.objectives.distill_config import DistillConfig
from train.objectives.preference_config import DPOConfig
from train.objectives.rl_config import RewardModelConfig, RLConfig


@dataclass
class DataConfig(LoaderConfig):
    """storage's LoaderConfig (all its keys); `dataset` may stay empty here when debug.synthetic_data is
    set: `TrainConfig.check_data` requires it otherwise, before any process starts."""
    seq_len: int = 256
    # Keep packed documents apart: positions restart and attention stays within each document (EOS ends
    # a document in pretraining rows). null: the objective's default (on for sft, off for pretrain and dpo).
    document_masking: bool | None = None
    # A later stage (mid-training, annealing) started with --init from the previous one reweights the
    # same dataset with this; pretraining objective only.
    mix: dict[str, float] = field(default_factory=dict)  # {source: weight} for this run; empty: the manifest's phases

    def validate(self) -> None:
        import dataclasses

        probe = self if self.dataset else dataclasses.replace(self, dataset="<unset>")
        try:
            LoaderConfig.validate(probe)
        except ConfigError as e:
            raise ConfigError(str(e).replace("key '", "key 'data.", 1)) from None


@dataclass
class BatchRampup:
    """Megatron-LM's --rampup-batch-size (train.rampup): the global batch starts at `start` sequences and
    grows by `increment` in equal steps of tokens consumed until, after `over_tokens`, it is
    parallel.global_batch_size."""
    start: int                       # global batch (sequences) of the first steps
    increment: int                   # sequences added at each ramp step
    over_tokens: int                 # tokens consumed over which the batch ramps up to parallel.global_batch_size

    def validate(self) -> None:
        for k in ("start", "increment", "over_tokens"):
            if getattr(self, k) < 1:
                raise ConfigError(f"key 'parallel.batch_rampup.{k}': must be >= 1, got {getattr(self, k)}")


@dataclass
class ParallelConfig:
    tp: int = 1                      # tensor parallel size
    pp: int = 1                      # pipeline parallel size; DP = world / (TP × PP)
    ep: int = 1                      # expert parallel size (MoE): routed experts split over this many data-parallel ranks; must divide DP and model.moe.num_experts
    micro_batch_size: int = 1        # sequences per micro-batch per DP rank
    global_batch_size: int = 8       # sequences per optimizer step over all DP ranks (after any ramp-up)
    batch_rampup: BatchRampup | None = None  # {start, increment, over_tokens}: ramp the global batch up; null: off
    distributed_optimizer: bool = False  # shard optimizer state over DP (ZeRO-1)
    overlap_grad_reduce: bool = False
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA, else gloo

    def validate(self) -> None:
        for k in ("tp", "pp", "ep", "micro_batch_size", "global_batch_size"):
            if getattr(self, k) < 1:
                raise ConfigError(f"key 'parallel.{k}': must be >= 1, got {getattr(self, k)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"key 'parallel.global_batch_size': {self.global_batch_size} is not a multiple of "
                              f"parallel.micro_batch_size {self.micro_batch_size}")
        r = self.batch_rampup
        if r is not None:
            if r.start >= self.global_batch_size:
                raise ConfigError(f"key 'parallel.batch_rampup.start': {r.start} must be below "
                                  f"parallel.global_batch_size {self.global_batch_size}")
            if (self.global_batch_size - r.start) % r.increment:
                raise ConfigError(f"key 'parallel.batch_rampup.increment': {r.increment} does not divide "
                                  f"parallel.global_batch_size - start = {self.global_batch_size - r.start}")

    def dp(self, world: int) -> int:
        return world // (self.tp * self.pp)

    def num_microbatches(self, world: int) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp(world))


@dataclass
class OptimConfig:
    lr: float = 3e-4                 # peak learning rate (after warmup)
    min_lr: float = 3e-5             # final learning rate of the cosine / WSD decay
    weight_decay: float = 0.1        # AdamW, decoupled; not applied to norm weights and biases (megatron's wd_mult 0)
    beta1: float = 0.9               # AdamW beta1
    beta2: float = 0.95              # AdamW beta2
    eps: float = 1e-8                # AdamW epsilon
    clip_grad: float = 1.0           # 0: no clipping
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # LR after warmup
    warmup_steps: int = 100          # linear warmup from lr/warmup_steps to lr
    decay_fraction: float = 0.1      # wsd: share of train steps spent in the final (linear) decay

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"key 'optim.min_lr': need 0 <= min_lr <= lr, got lr={self.lr} min_lr={self.min_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"key 'optim.warmup_steps': must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"key 'optim.decay_fraction': must be in [0, 1], got {self.decay_fraction}")
        if self.clip_grad < 0:
            raise ConfigError(f"key 'optim.clip_grad': must be >= 0, got {self.clip_grad}")


@dataclass
class SpikeConfig:
    """A loss is a spike when (loss - mean) / std over the last `window` accepted losses > `zscore`."""
    window: int = 100                # accepted losses the z-score is computed over
    zscore: float = 6.0              # a loss this many standard deviations above the mean is a spike
    min_history: int = 20            # no decisions before this many losses are known
    policy: Literal["log", "skip", "abort"] = "log"  # on a spike: log it, skip the update, or stop


@dataclass
class WandbConfig:
    """Weights & Biases (train.monitor.trackers): one W&B run per training run, continued on resume."""
    enabled: bool = False
    project: str = "smoltrain"
    entity: str = ""                 # team or user ("": your default entity)
    name: str = ""                   # run name ("": the run directory's name)
    mode: Literal["online", "offline"] = "online"  # offline: a local run folder that `wandb sync` uploads later
    dir: str = ""                    # where the wandb/ folder goes ("": RUN_DIR)
    tags: list[str] = field(default_factory=list)
    init_timeout_s: float = 90.0     # give up on an unreachable server after this (one warning, training goes on)


@dataclass
class MlflowConfig:
    """MLflow (train.monitor.trackers): one MLflow run per training run, continued on resume."""
    enabled: bool = False
    tracking_uri: str = ""           # http(s)://server, sqlite:///path.db, databricks ("": $MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db)
    experiment: str = "smoltrain"    # created when missing
    run_name: str = ""               # "": the run directory's name


@dataclass
class MonitorConfig:
    log_every: int = 10              # steps between console/JSONL/TensorBoard/tracker records
    tensorboard: bool = True         # also write TensorBoard events to RUN_DIR/tb
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    peak_flops: float | None = None  # per device; null: H100/H200 defaults on CUDA, MFU off on CPU
    comm_share: bool = True          # time collectives (train.monitor.comm) and log comm_share: the step's share blocked in them


@dataclass
class AlertConfig:
    mfu_warn_below: float = 0.30     # warn when MFU stays below this for mfu_window records in a row (0: off)
    mfu_window: int = 5              # consecutive log records below mfu_warn_below before the MFU warning (once per episode)
    comm_share_warn_above: float = 0.15  # warn when a log window's comm_share is above this (once per episode; 0: off)
    memory_stop_above: float = 0.90  # stop cleanly (after a checkpoint) above this memory fraction (0: off)
    max_consecutive_skips: int = 20  # abort when this many steps in a row are skipped
    moe_idle_expert_steps: int = 100  # MoE: warn when an expert has received no token for this many steps (log windows; 0: off)

    def validate(self) -> None:
        if self.mfu_window < 1:
            raise ConfigError(f"key 'alerts.mfu_window': must be >= 1, got {self.mfu_window}")
        for k in ("mfu_warn_below", "comm_share_warn_above", "memory_stop_above"):
            if not 0.0 <= getattr(self, k) <= 1.0:
                raise ConfigError(f"key 'alerts.{k}': must be in [0, 1], got {getattr(self, k)}")


@dataclass
class SlurmConfig:
    job_name: str = "smoltrain"      # sbatch --job-name
    nodes: int = 1                   # sbatch --nodes (world = nodes × gpus_per_node)
    gpus_per_node: int = 8           # processes (GPUs) per node
    cpus_per_task: int = 32          # sbatch --cpus-per-task (one task per node)
    partition: str = ""              # sbatch --partition (empty: cluster default)
    account: str = ""                # sbatch --account (empty: none)
    time: str = "24:00:00"           # sbatch --time
    requeue: bool = True             # sbatch --requeue: a requeued job resumes from the newest checkpoint
    extra_sbatch: list[str] = field(default_factory=list)      # raw "#SBATCH" arguments
    env: dict[str, str] = field(default_factory=lambda: {  # exported before srun (NCCL settings)
        "NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "^lo,docker", "NCCL_DEBUG": "WARN",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    setup: list[str] = field(default_factory=list)              # shell lines before srun (modules, venv)


@dataclass
class LaunchConfig:
    nproc: int | None = None         # processes per node; null: GPUs on the node, or 1 on CPU
    nnodes: int = 1                  # nodes; > 1 uses c10d rendezvous at rdzv_endpoint
    node_rank: int | None = None     # null: let c10d assign
    rdzv_backend: str = "c10d"       # torchrun --rdzv-backend (multi-node)
    rdzv_endpoint: str = "127.0.0.1:29500"  # HOST:PORT of the rendezvous (first node)
    rdzv_id: str = "smoltrain"       # job id shared by all nodes of one run
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # `train launch --slurm` script settings


@dataclass
class DebugConfig:
    synthetic_data: bool = False     # random tokens generated in memory instead of data.dataset
    inject_nan_step: int = -1        # make the loss NaN at this step (tests the skip-and-count path)
    inject_spike_step: int = -1      # multiply the loss by 100 at this step (tests spike detection)
    comm_delay_s: float = 0.0        # slow network: collectives wait this long in the process group (tests comm_share)
    comm_delay_from_step: int = 1    # ...in steps from this one on (1-based, as logged)

    def validate(self) -> None:
        if self.comm_delay_s < 0:
            raise ConfigError(f"key 'debug.comm_delay_s': must be >= 0, got {self.comm_delay_s}")


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"    # resolved config, metrics.jsonl, tb/, checkpoints/ go here
    steps: int = 100                 # training steps (optimizer steps, skipped ones included)
    stop_at: int | None = None       # stop cleanly (checkpoint saved) at this step; schedules still span `steps`
    seed: int = 1234                 # model seed; the data seed is data.seed (shared by DP ranks)
    # pretrain: next-token loss on every token of a token stream; sft: whole documents packed best-fit
    # decreasing, loss on the tokens their mask marks, normalised by the global count of such tokens
    # dpo: preference pairs (global_batch_size and micro_batch_size count pairs), the `dpo` section's loss;
    # reward: a reward model (scalar head) on preference pairs, Bradley-Terry loss; grpo, rloo, ppo: online RL
    # on prompts (global_batch_size and micro_batch_size count prompts; the `rl` section); distill (token stream),
    # distill_sft (conversations): a student trained on a frozen teacher's distributions (the `distill` section);
    # or an objective a module in `imports` registers (train.objectives)
    objective: str = "pretrain"
    imports: list[str] = field(default_factory=list)  # Python modules every process imports first (plugins: objectives)
    epochs: float | None = None      # objectives over whole rows (sft, dpo, reward, grpo/rloo/ppo): passes over the dataset; sets steps (schedules span them)
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"  # bf16: bf16 weights/activations, fp32 master + grads; fp8: bf16 + FP8 GEMMs via Transformer Engine (GPU >= sm89)
    init: str | None = None          # start from this checkpoint's weights (fresh optimizer/schedule/data, step 0; model shape from it); resume wins
    init_keep_optimizer: bool = False  # with init (a new stage): also load its optimizer state (AdamW moments, step); schedule, data and step still start fresh
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    alerts: AlertConfig = field(default_factory=AlertConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)  # objectives grpo, rloo, ppo
    reward: RewardModelConfig = field(default_factory=RewardModelConfig)  # objective reward
    distill: DistillConfig = field(default_factory=DistillConfig)  # objectives distill, distill_sft: the teacher and the loss
    debug: DebugConfig = field(default_factory=DebugConfig)

    def validate(self) -> None:
        """Checks that need no world size; run on every load."""
        if self.steps < 1:
            raise ConfigError(f"key 'steps': must be >= 1, got {self.steps}")
        objectives.import_plugins(self.imports)
        objective = objectives.get(self.objective)
        stream = objective.data == "tokens"  # an endless token stream, not whole rows with epochs
        if self.epochs is not None and (stream or self.epochs <= 0):
            raise ConfigError(f"key 'epochs': needs an objective over whole rows (sft, dpo) and a positive value, "
                              f"got {self.epochs} with objective {self.objective}")
        objective.validate(self)
        if self.data.mix and not stream:
            raise ConfigError(f"key 'data.mix': reweights pretraining sources; objective {self.objective} reads "
                              "every conversation or pair of its dataset")
        for src, w in self.data.mix.items():
            if not (isinstance(w, (int, float)) and w > 0):
                raise ConfigError(f"key 'data.mix.{src}': weight must be > 0, got {w!r}")
        if self.data.document_masking and self.debug.synthetic_data:
            raise ConfigError("key 'data.document_masking': synthetic data has no documents")
        if not stream and self.debug.synthetic_data:
            raise ConfigError(f"key 'objective': {self.objective} needs a dataset (debug.synthetic_data has none)")
        r = self.parallel.batch_rampup
        if r is not None and not stream:
            raise ConfigError(f"key 'parallel.batch_rampup': pretraining only (objective {self.objective} has "
                              "rows of packed conversations or pairs, cut per batch)")
        if r is not None and r.over_tokens < self.data.seq_len:
            raise ConfigError(f"key 'parallel.batch_rampup.over_tokens': {r.over_tokens} is less than one "
                              f"sequence (data.seq_len {self.data.seq_len})")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ConfigError(f"key 'stop_at': must be between 1 and steps ({self.steps}), got {self.stop_at}")
        m, p = self.model.resolved(), self.parallel
        if p.tp > m.num_heads or m.num_heads % p.tp:
            raise ConfigError(f"key 'parallel.tp': {p.tp} must divide model.num_heads ({m.num_heads})")
        if m.num_kv_heads % p.tp:
            raise ConfigError(f"key 'parallel.tp': {p.tp} must divide model.num_kv_heads ({m.num_kv_heads})")
        if m.num_layers % p.pp:
            raise ConfigError(f"key 'parallel.pp': {p.pp} must divide model.num_layers ({m.num_layers})")
        if self.data.seq_len > m.max_position_embeddings:
            raise ConfigError(f"key 'data.seq_len': {self.data.seq_len} exceeds model.max_position_embeddings "
                              f"({m.max_position_embeddings})")
        if p.distributed_optimizer and self.checkpoint.distrib_optim_sharding_type == "dp_reshardable":
            raise ConfigError("key 'checkpoint.distrib_optim_sharding_type': dp_reshardable resumes wrongly "
                              "with megatron-core 0.16 (notes/megatron-cpu.md); use fully_reshardable")

    def bf16_weights(self) -> bool:
        """bf16 weights and activations (Float16Module, bf16 optimizer): precision bf16, and fp8, whose FP8
        GEMMs Transformer Engine computes from bf16 weights."""
        return self.precision in ("bf16", "fp8")

    def check_world(self, world: int) -> None:
        """Checks for a given number of processes on this machine; `train launch` runs them before starting
        torchrun (and every process again at start). Includes the fp8 hardware check."""
        self.check_precision()
        self.check_layout(world)

    def check_layout(self, world: int) -> None:
        """The TP × PP × DP layout and batch divisibility for `world` processes, on any machine (`train
        estimate` sizes GPU runs anywhere)."""
        p = self.parallel
        if world % (p.tp * p.pp):
            raise ConfigError(f"key 'parallel.tp': world size {world} is not divisible by tp × pp = "
                              f"{p.tp} × {p.pp}")
        dp = p.dp(world)
        if problem := layout_problem(self.model.moe, p.tp, p.ep, dp):  # MoE: EP divides DP and the experts; TP 1
            raise ConfigError(problem)
        if p.global_batch_size % (p.micro_batch_size * dp):
            raise ConfigError(f"key 'parallel.global_batch_size': {p.global_batch_size} is not divisible by "
                              f"micro_batch_size × dp = {p.micro_batch_size} × {dp}")
        for k in ("start", "increment") if p.batch_rampup else ():
            if getattr(p.batch_rampup, k) % (p.micro_batch_size * dp):
                raise ConfigError(f"key 'parallel.batch_rampup.{k}': {getattr(p.batch_rampup, k)} is not divisible "
                                  f"by micro_batch_size × dp = {p.micro_batch_size} × {dp} (every step's batch "
                                  "must be whole micro-batches on every DP rank)")

    def check_precision(self) -> None:
        """precision fp8 needs Transformer Engine and CUDA GPUs of compute capability >= 8.9 here."""
        if self.precision != "fp8":
            return
        from train.model.precision import fp8_unsupported_reasons

        reasons = fp8_unsupported_reasons()
        if reasons:
            raise ConfigError("key 'precision': fp8 runs through Transformer Engine on a GPU of compute "
                              f"capability >= 8.9 (Ada, Hopper or newer), not here: {'; '.join(reasons)}. "
                              "Use precision bf16")

    def check_data(self) -> None:
        """The dataset must exist (unless synthetic) and fit the model's vocabulary; the objective's own
        checks (dpo: a reference; rl: answers for the rewards that need them), once the dataset is known."""
        if self.eval.tasks:
            self.eval.check_tasks()  # unknown names and malformed task files fail here, before torchrun
            if self.debug.synthetic_data or not self.data.dataset:
                raise ConfigError("key 'eval.tasks': benchmarks need the dataset's tokenizer; set data.dataset "
                                  "(synthetic data has no tokenizer)")
        if self.debug.synthetic_data:
            objectives.get(self.objective).check_data(self)
            return
        if not self.data.dataset:
            raise ConfigError("key 'data.dataset': required (a dataset folder or URL), or set "
                              "debug.synthetic_data: true")
        from storage.manifest import read_manifest

        try:
            man = read_manifest(self.data.dataset)
        except Exception as e:  # noqa: BLE001 - any failure to read is a config problem here
            raise ConfigError(f"key 'data.dataset': cannot read a manifest at {self.data.dataset!r}: {e}") from None
        for src in self.data.mix:
            if src not in man.sources:
                raise ConfigError(f"key 'data.mix.{src}': no such source in {self.data.dataset} "
                                  f"(sources: {', '.join(sorted(man.sources))})")
        vocab = self.model.resolved().vocab_size
        if self.model.vocab_size is not None and man.tokenizer.vocab_size > vocab:
            raise ConfigError(f"key 'model.vocab_size': {vocab} is smaller than the dataset tokenizer's "
                              f"{man.tokenizer.vocab_size}")
        objectives.get(self.objective).check_data(self)

    def document_masking(self) -> bool:
        if self.data.document_masking is None:
            return objectives.get(self.objective).document_masking
        return self.data.document_masking

    def resolved_for_data(self) -> TrainConfig:
        """A copy whose model vocab is the dataset tokenizer's when model.vocab_size is null, and whose
        steps are those of `epochs` over the packed dataset when epochs is set."""
        import dataclasses

        if self.debug.synthetic_data or not self.data.dataset:
            return self
        out = self
        if self.model.vocab_size is None:
            from storage.manifest import read_manifest

            vocab = read_manifest(self.data.dataset).tokenizer.vocab_size
            out = dataclasses.replace(out, model=dataclasses.replace(self.model, vocab_size=vocab))
        if self.epochs is not None:
            from train.data import rows_in_epochs

            rows = rows_in_epochs(self.data, objectives.get(self.objective).data, self.epochs)
            steps = rows // self.parallel.global_batch_size
            if steps < 1:
                raise ConfigError(f"key 'epochs': {self.epochs} epochs of {rows} rows (pairs) make no global batch "
                                  f"of {self.parallel.global_batch_size}")
            out = dataclasses.replace(out, steps=steps, stop_at=None if self.stop_at is None else min(self.stop_at,
                                                                                                      steps))
        return out
