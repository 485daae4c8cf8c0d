"""Start a run from an existing model's weights: `train launch CONFIG --init CHECKPOINT` (config key `init`).

Weights only: the optimizer, LR schedule, loader and step start fresh. Any smoltrain checkpoint (full or
incremental, any TP/PP layout, any precision: weights are cast to the run's) is resharded on load, like
`train eval` does. Resume wins: the Trainer loads `init` only when the run has no checkpoint to resume
from, so a restarted fine-tuning run continues rather than starting over.

Before torchrun (`resolve`, from train.launch.prepare): the checkpoint must exist and verify (a run
directory or checkpoints folder means its newest checkpoint that verifies); `init` becomes that step
folder's absolute path, and the model shape comes from the checkpoint's recorded model config:

- a shape key left null in the config (hidden_size, num_layers, num_heads, num_kv_heads, ffn_hidden_size,
  vocab_size, max_position_embeddings, rope_theta, norm_eps, no_rope_every, head_dim) takes the checkpoint's value (the preset
  does not apply to it); a key set in the config must equal the checkpoint's, except the stage keys
  rope_theta and max_position_embeddings (no parameter has their shape: a new stage may raise them, e.g. a
  long-context stage);
- tie_embeddings and make_vocab_size_divisible_by take the checkpoint's value when the config leaves
  their defaults (true, 128), and must equal it otherwise;
- every disagreeing key is named in one error (`key 'model.hidden_size': 128 in the config, 64 in ...`);
- the embedding rows at the run's TP (vocab padded to make_vocab_size_divisible_by × TP) must equal the
  checkpoint's;
- with `init_keep_optimizer` (`--keep-optimizer`): the checkpoint must hold optimizer state, of the run's
  precision and kind (plain or distributed optimizer, when the checkpoint records it); TP/PP/DP may differ
  (resharded on load, as resume does).

Stages: every checkpoint's manifest records `meta.stages`, the run's stage history: the init checkpoint's
own history (one synthesized entry when it recorded none: imported, merged or older checkpoints) plus
this run's entry (`stage_history`).
"""
from __future__ import annotations

import dataclasses
import os

import fsspec

from storage.config import ConfigError
from train.checkpoint import layout
from train.model.moe import MoEConfig

NULLABLE = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "vocab_size",
            "max_position_embeddings", "rope_theta", "norm_eps", "no_rope_every")
# model.moe left at its default (dense) takes the checkpoint's experts; a different MoE section is refused
DEFAULTED = {"tie_embeddings": True, "make_vocab_size_divisible_by": 128, "moe": MoEConfig()}
# set in the config, these may differ from the checkpoint's: no parameter shape depends on them (RoPE has no
# learned positions); a new stage raises them (long context: seq_len 4k -> 32k -> 64k, RoPE theta raised)
STAGE_KEYS = ("rope_theta", "max_position_embeddings")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def find_checkpoint(path: str, what: str = "key 'init'") -> str:
    """The step folder `path` names (itself, or the newest verifying one of a run dir / checkpoints root),
    verified (sizes and checksums, with its base). Raises ConfigError naming the problem (after `what`)."""
    fs = fsspec.filesystem("file")
    p = os.path.abspath(path.removeprefix("file://").rstrip("/"))
    if not os.path.isdir(p):
        raise ConfigError(f"{what}: {path}: no such checkpoint folder")
    if os.path.isfile(os.path.join(p, layout.MANIFEST)):
        root, name = os.path.split(p)
        problems = layout.verify(fs, root, name)
        if problems:
            raise ConfigError(f"{what}: {p} does not verify: " + "; ".join(problems[:5]))
        return p
    root = os.path.join(p, "checkpoints") if os.path.isdir(os.path.join(p, "checkpoints")) else p
    names = layout.checkpoint_names(fs, root)
    for name in reversed(names):
        if not layout.verify(fs, root, name):
            return os.path.join(root, name)
    raise ConfigError(f"{what}: {path}: " + ("no checkpoint there verifies" if names else
                                                 "not a checkpoint (no manifest.json) and holds no checkpoints"))


def resolve(cfg) -> None:
    """Validate cfg.init and fill the model shape from the checkpoint, in place (a TrainConfig)."""
    if not cfg.init:
        if cfg.init_keep_optimizer:
            raise ConfigError("key 'init_keep_optimizer': needs a checkpoint to start from (key 'init', --init)")
        return
    ckpt = find_checkpoint(cfg.init)
    m = layout.read_manifest(fsspec.filesystem("file"), ckpt)
    meta = m.get("meta") or {}
    if "model" not in meta:
        raise ConfigError(f"key 'init': {ckpt}: its manifest records no model config (meta.model)")
    from train.model.gpt import ModelConfig

    known = set(ModelConfig.__dataclass_fields__)
    ck = ModelConfig(**{k: v for k, v in meta["model"].items() if k in known}).resolved()
    model, updates, bad = cfg.model, {}, []
    for k in NULLABLE:
        mine, theirs = getattr(model, k), getattr(ck, k)
        if mine is None:
            updates[k] = theirs
        elif mine != theirs and k not in STAGE_KEYS:
            bad.append((k, mine, theirs))
    for k, default in DEFAULTED.items():
        mine, theirs = getattr(model, k), getattr(ck, k)
        if mine == default:
            updates[k] = theirs
        elif mine != theirs:
            bad.append((k, mine, theirs))
    if bad:
        raise ConfigError("; ".join(f"key 'model.{k}': {a!r} in the config, {b!r} in the --init checkpoint {ckpt}"
                                    for k, a, b in bad) + " (leave shape keys null to take the checkpoint's)")
    cfg.model = dataclasses.replace(model, **updates)
    cfg.init = ckpt
    cfg.validate()
    rows = meta.get("padded_vocab_size")
    if rows is not None and cfg.model.padded_vocab_size(cfg.parallel.tp) != rows:
        raise ConfigError(f"key 'parallel.tp': the embedding would have {cfg.model.padded_vocab_size(cfg.parallel.tp)} "
                          f"rows at tp={cfg.parallel.tp} (vocab {cfg.model.vocab_size} padded to a multiple of "
                          f"model.make_vocab_size_divisible_by × tp), the --init checkpoint {ckpt} has {rows}: "
                          "choose a TP (or make_vocab_size_divisible_by) that gives the same padding")
    if cfg.init_keep_optimizer:
        _check_optimizer(cfg, ckpt, m)


def _check_optimizer(cfg, ckpt: str, m: dict) -> None:
    """--keep-optimizer: the checkpoint holds optimizer state this run can load (same precision and kind)."""
    meta = m.get("meta") or {}
    what = f"key 'init_keep_optimizer': the --init checkpoint {ckpt}"
    origin = "a merge" if meta.get("merge") else "an import" if (meta.get("hf") or {}).get("source") else None
    if origin:
        raise ConfigError(f"{what} is {origin} and holds no optimizer state; start without --keep-optimizer")
    mine = "bf16" if cfg.bf16_weights() else "fp32"
    if meta.get("precision", "fp32") != mine:
        raise ConfigError(f"{what} has {meta.get('precision', 'fp32')} weights, this run {mine} "
                          f"(precision {cfg.precision}): its optimizer state does not fit; use the checkpoint's "
                          "precision or start without --keep-optimizer")
    opt = meta.get("optimizer")
    if opt is not None and bool(opt.get("distributed")) != cfg.parallel.distributed_optimizer:
        raise ConfigError(f"{what} was written with parallel.distributed_optimizer {bool(opt.get('distributed'))}, "
                          f"this run has {cfg.parallel.distributed_optimizer}: the optimizer state cannot be "
                          "converted between the two; set parallel.distributed_optimizer to the checkpoint's "
                          "(TP/PP/DP may differ) or start without --keep-optimizer")
    if opt is not None and opt.get("distributed") and \
            opt.get("sharding_type") != cfg.checkpoint.distrib_optim_sharding_type:
        raise ConfigError(f"{what} was written with checkpoint.distrib_optim_sharding_type "
                          f"{opt.get('sharding_type')!r}, this run has {cfg.checkpoint.distrib_optim_sharding_type!r}:"
                          " use the checkpoint's")
    if not _has_optimizer(ckpt, m):
        raise ConfigError(f"{what} holds no optimizer state; start without --keep-optimizer")


def _has_tensor(ckpt: str, m: dict, prefix: str) -> bool:
    """Whether the checkpoint (its base) stores a tensor whose key starts with `prefix` (True when unknown)."""
    from train.checkpoint.incremental import RAW_DIR, PieceSet

    base = os.path.join(os.path.dirname(ckpt), m["base"]) if m.get("base") else ckpt
    if not os.path.isdir(os.path.join(base, RAW_DIR)):
        return True
    return any(k.startswith(prefix) for k in PieceSet(base, RAW_DIR).keys())


def _has_optimizer(ckpt: str, m: dict) -> bool:
    """Whether the checkpoint (its base, for an incremental one) stores optimizer tensors; True when unknown
    (a torch_dist base: the load itself then says what is missing)."""
    from train.checkpoint.incremental import RAW_DIR, PieceSet

    base = os.path.join(os.path.dirname(ckpt), m["base"]) if m.get("base") else ckpt
    if not os.path.isdir(os.path.join(base, RAW_DIR)):
        return True
    return any(k.startswith("optimizer") for k in PieceSet(base, RAW_DIR).keys())


def stage_history(cfg) -> list[dict]:
    """meta.stages for this run's checkpoints: the --init checkpoint's stages (or one entry made from what
    its manifest records, `recorded: false`) followed by this run's stage. A run without init is stage 0."""
    stages: list[dict] = []
    init_step = None
    if cfg.init:
        try:
            m = layout.read_manifest(fsspec.filesystem("file"), cfg.init)
        except Exception:  # noqa: BLE001 - e.g. deleted since this run started: its history is unknown then
            m = {"meta": {}}
        meta = m.get("meta") or {}
        init_step = m.get("step")
        stages = [dict(s) for s in meta.get("stages") or []]
        if not stages:
            origin = "merge" if meta.get("merge") else "import" if (meta.get("hf") or {}).get("source") else \
                "unrecorded" if "step" in m else "unreadable"
            stages = [{"stage": 0, "recorded": False, "origin": origin, "init": None, "init_step": None,
                       "seq_len": meta.get("seq_len"), "rope_theta": (meta.get("model") or {}).get("rope_theta"),
                       "dataset": None, "mix": None, "kept_optimizer": None}]
    mod = cfg.model.resolved()
    stages.append({"stage": len(stages), "init": cfg.init, "init_step": init_step, "objective": cfg.objective,
                   "seq_len": cfg.data.seq_len, "rope_theta": mod.rope_theta,
                   "max_position_embeddings": mod.max_position_embeddings,
                   "dataset": "synthetic" if cfg.debug.synthetic_data else
                   cfg.data.dataset if "://" in cfg.data.dataset else os.path.abspath(cfg.data.dataset),
                   "mix": dict(cfg.data.mix) or None, "kept_optimizer": bool(cfg.init and cfg.init_keep_optimizer),
                   "steps": cfg.steps, "schedule": cfg.optim.schedule, "lr": cfg.optim.lr, "min_lr": cfg.optim.min_lr})
    return stages


def _retype(sd: dict, dtype) -> None:
    """Point the sharded state dict's tensors at empty ones of the checkpoint's dtype (loaded values are cast
    into the parameters by load_state_dict)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for k, v in sd.items():
        if isinstance(v, dict):
            _retype(v, dtype)
        elif isinstance(v, ShardedTensor) and v.data.dtype != dtype:
            v.data, v.dtype = torch.empty_like(v.data, dtype=dtype), dtype
        elif isinstance(v, ShardedTensorFactory) and v.data.dtype != dtype:
            v.data = torch.empty_like(v.data, dtype=dtype)


def load_weights(model: list, optimizer, ckpt: str, fresh: tuple[str, ...] = ()) -> dict:
    """Load the model weights of checkpoint folder `ckpt` into `model` (chunks, wrapped or not) under this
    process's TP/PP layout; the optimizer's main parameters (bf16 runs) are refreshed from them. Parameters
    whose names start with a `fresh` prefix (an objective's new heads) keep their initial values when the
    checkpoint does not have them. Returns the checkpoint's manifest. Collective: every rank calls it."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from train.checkpoint.state_io import model_key
    from train.checkpoint.strategies import DeltaAwareLoadStrategy

    root, name = os.path.split(os.path.abspath(ckpt.rstrip("/")))
    m = layout.read_manifest(fsspec.filesystem("file"), ckpt)
    base = m.get("base") or name
    strategy = DeltaAwareLoadStrategy(os.path.join(root, base), ckpt if m["kind"] == "incremental" else None)
    chunks = unwrap_model(model)
    absent = tuple(f for f in fresh if not _has_tensor(ckpt, m, f))
    sd = {model_key(i, len(chunks)): {k: v for k, v in c.sharded_state_dict().items() if not k.startswith(absent or "\0")}
          for i, c in enumerate(chunks)}
    dtype = getattr(torch, _DTYPES.get((m.get("meta") or {}).get("precision", "fp32"), "float32"))
    _retype(sd, dtype)
    try:
        loaded = dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
    except Exception as e:
        raise layout.CheckpointError(f"{ckpt}: loading its weights failed: {e}") from e
    for i, c in enumerate(chunks):
        missing, unexpected = c.load_state_dict(loaded[model_key(i, len(chunks))], strict=not absent)
        if unexpected or [k for k in missing if not k.startswith(absent)]:
            raise layout.CheckpointError(f"{ckpt}: weights do not fit the model (missing {missing}, "
                                         f"unexpected {unexpected})")
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    return m


def frozen_model(model_cfg, cfg, par, ckpt: str) -> list:
    """The model chunks of `model_cfg` under the run's TP × PP layout with `ckpt`'s weights, on the GPU when
    there is one, in eval mode and without gradients: a DPO reference or a distillation teacher."""
    import torch

    from train.model.gpt import build_model

    chunks = build_model(model_cfg, tp=par.tp, pp=par.pp, bf16=cfg.bf16_weights(), seed=cfg.seed)
    if torch.cuda.is_available():
        for c in chunks:
            c.cuda(torch.cuda.current_device())
    load_weights(chunks, None, ckpt)
    for c in chunks:
        c.eval()
        c.requires_grad_(False)
    return chunks
