"""Model presets (SmolLM2 / SmolLM3 / Llama shapes) → megatron-core TransformerConfig and GPTModel.

All presets are Llama-style: RMSNorm, SwiGLU, RoPE (configurable θ), GQA, no biases, tied embeddings.
The published shapes:

| preset | hidden | layers | heads | kv | ffn   | vocab   | θ       | NoPE every | source            |
|--------|--------|--------|-------|----|-------|---------|---------|------------|-------------------|
| tiny   | 128    | 4      | 4     | 2  | 352   | 1024    | 10 000  | -          | CPU tests         |
| 135m   | 576    | 30     | 9     | 3  | 1536  | 49 152  | 100 000 | -          | SmolLM2-135M      |
| 360m   | 960    | 32     | 15    | 5  | 2560  | 49 152  | 100 000 | -          | SmolLM2-360M      |
| 1.7b   | 2048   | 24     | 32    | 32 | 8192  | 49 152  | 130 000 | -          | SmolLM2-1.7B      |
| 3b     | 2048   | 36     | 16    | 4  | 11008 | 128 256 | 5e6     | 4          | SmolLM3-3B        |

NoPE (`no_rope_every: N`, megatron's `no_rope_freq`): layers N, 2N, 3N, ... (1-based) get no rotary
embedding, as SmolLM3 (transformers' `no_rope_layers[i] = int((i + 1) % N != 0)`, 1 = RoPE); it adds no
parameters. It is passed to megatron as a per-layer list, so the depth need not be a multiple of N, and
it works with the local layer spec (megatron's attention drops `rotary_pos_emb` for those layers).

Activation recompute (`recompute`): `selective` is megatron's `recompute_granularity='selective'` with its
default `recompute_modules=['core_attn']` (the attention scores / softmax / dropout region is recomputed
in the backward pass: a saving only where attention is not fused, e.g. the local spec); `full` recomputes
whole layers from their inputs: `recompute_layers: k` → megatron `recompute_method='block'` with k layers
per pipeline stage, null (or k ≥ the stage's layers) → `'uniform'` with 1 layer per unit (every layer).
Both give bit-identical losses and gradients on CPU (tests at TP1, TP2, PP2).

Mixture of experts (`model.moe`, train.model.moe): every layer's MLP becomes megatron-core's MoE layer
(router, routed experts, optional shared expert); `num_parameters` then counts total and active parameters,
and the layout-invariant init seeds each expert by its global index, so every `parallel.ep` starts alike.

megatron is imported lazily so that config validation and `train estimate` stay fast.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from storage.config import ConfigError
from train.model.moe import MoEConfig, fix_megatron_without_te, global_expert_name, mlp_parameters, transformer_kwargs

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=352,
                 vocab_size=1024, max_position_embeddings=1024, rope_theta=10000.0, norm_eps=1e-5,
                 no_rope_every=0),
    "135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, ffn_hidden_size=1536,
                 vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, norm_eps=1e-5,
                 no_rope_every=0),
    "360m": dict(hidden_size=960, num_layers=32, num_heads=15, num_kv_heads=5, ffn_hidden_size=2560,
                 vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, norm_eps=1e-5,
                 no_rope_every=0),
    "1.7b": dict(hidden_size=2048, num_layers=24, num_heads=32, num_kv_heads=32, ffn_hidden_size=8192,
                 vocab_size=49152, max_position_embeddings=8192, rope_theta=130000.0, norm_eps=1e-5,
                 no_rope_every=0),
    "3b": dict(hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=4, ffn_hidden_size=11008,
               vocab_size=128256, max_position_embeddings=65536, rope_theta=5_000_000.0, norm_eps=1e-6,
               no_rope_every=4),
}
# Keys a preset fills; SHAPE_KEYS are the positive sizes among them.
PRESET_KEYS = tuple(PRESETS["tiny"])
SHAPE_KEYS = tuple(k for k in PRESET_KEYS if k != "no_rope_every")


@dataclass
class ModelConfig:
    """`preset` fills every shape key left null; any key set here overrides the preset."""
    preset: str = "tiny"             # tiny, 135m, 360m, 1.7b (SmolLM2), 3b (SmolLM3)
    hidden_size: int | None = None   # null: the preset's (same for every shape key below)
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None  # GQA query groups
    head_dim: int | None = None      # attention head size (megatron kv_channels); null: hidden_size / num_heads (a pruned model keeps its heads' size)
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None  # null: preset's, or the dataset tokenizer's when the trainer knows it
    max_position_embeddings: int | None = None
    rope_theta: float | None = None  # RoPE base θ
    norm_eps: float | None = None    # RMSNorm epsilon
    no_rope_every: int | None = None  # NoPE: layers N, 2N, ... (1-based) skip RoPE (megatron no_rope_freq); 0: RoPE in all; null: preset's (3b: 4)
    tie_embeddings: bool = True      # output layer shares the embedding matrix
    init_std: float = 0.02           # normal init std; output projections use std / sqrt(2 · layers)
    dropout: float = 0.0             # hidden and attention dropout
    # Pad the embedding table to a multiple of this (and of TP) for fast GEMMs, as Megatron-LM does.
    make_vocab_size_divisible_by: int = 128
    # layout_invariant: every parameter is drawn from a generator seeded by (seed, its global name) and
    # then sliced, so TP/PP layouts start from identical weights; megatron: megatron's own init.
    init: Literal["layout_invariant", "megatron"] = "layout_invariant"
    recompute: Literal["none", "selective", "full"] = "none"  # activation recompute: selective = attention scores/softmax (megatron core_attn); full = whole layers
    recompute_layers: int | None = None  # full: layers recomputed per pipeline stage (megatron block method); null: every layer
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture of experts (train.model.moe); num_experts 0: dense

    def __post_init__(self):
        if isinstance(self.moe, dict):  # a checkpoint manifest's plain model section
            self.moe = MoEConfig(**self.moe)

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"key 'model.preset': unknown preset {self.preset!r}; "
                              f"known: {', '.join(PRESETS)}")
        s = self.resolved()
        for k in SHAPE_KEYS:
            if getattr(s, k) <= 0:
                raise ConfigError(f"key 'model.{k}': must be positive, got {getattr(s, k)}")
        if s.head_dim is not None and s.head_dim <= 0:
            raise ConfigError(f"key 'model.head_dim': must be positive or null, got {s.head_dim}")
        if s.head_dim is None and s.hidden_size % s.num_heads:
            raise ConfigError(f"key 'model.num_heads': {s.num_heads} does not divide hidden_size "
                              f"{s.hidden_size}")
        if s.num_heads % s.num_kv_heads:
            raise ConfigError(f"key 'model.num_kv_heads': {s.num_kv_heads} does not divide num_heads "
                              f"{s.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"key 'model.dropout': must be in [0, 1), got {self.dropout}")
        if not 0 <= s.no_rope_every <= s.num_layers:
            raise ConfigError(f"key 'model.no_rope_every': must be 0 (RoPE in every layer) or 1..num_layers "
                              f"({s.num_layers}), got {s.no_rope_every}")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError(f"key 'model.recompute': none, selective or full, got {self.recompute!r}")
        if self.recompute_layers is not None:
            if self.recompute != "full":
                raise ConfigError(f"key 'model.recompute_layers': only with model.recompute: full (megatron's "
                                  f"block method), got recompute {self.recompute!r}")
            if not 1 <= self.recompute_layers <= s.num_layers:
                raise ConfigError(f"key 'model.recompute_layers': must be 1..num_layers ({s.num_layers}) or "
                                  f"null (every layer), got {self.recompute_layers}")
        self.moe.validate()

    def resolved(self) -> ModelConfig:
        """A copy with every preset key filled in."""
        base = PRESETS.get(self.preset, PRESETS["tiny"])
        return dataclasses.replace(self, **{k: v for k, v in base.items() if getattr(self, k) is None})

    def no_rope_layers(self) -> list[int] | None:
        """megatron's `no_rope_freq` as a per-layer list (1 = no RoPE in that layer), or None for all-RoPE.
        The inverse of transformers' SmolLM3 `no_rope_layers` (1 = RoPE)."""
        s = self.resolved()
        n = s.no_rope_every
        return [int((i + 1) % n == 0) for i in range(s.num_layers)] if n else None

    def kv_channels(self) -> int:
        """The attention head size: head_dim, else hidden_size / num_heads."""
        s = self.resolved()
        return s.head_dim or s.hidden_size // s.num_heads

    def recompute_layers_per_stage(self, pp: int = 1) -> int:
        """Layers of one pipeline stage whose activations are recomputed (full recompute), else 0."""
        if self.recompute != "full":
            return 0
        per_stage = self.resolved().num_layers // pp
        return per_stage if self.recompute_layers is None else min(self.recompute_layers, per_stage)

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Embedding rows: vocab rounded up to a multiple of make_vocab_size_divisible_by × TP."""
        v = self.resolved().vocab_size
        m = max(1, self.make_vocab_size_divisible_by) * tp
        return -(-v // m) * m


def transformer_config(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, bf16: bool = False,
                       per_token_loss: bool = False, precision: str = "fp32", ep: int = 1):
    """megatron TransformerConfig for `cfg`. TP and PP sizes must be given, or every pipeline stage
    silently builds all layers. `per_token_loss`: micro-batch losses are sums, and gradients are divided
    by the step's global count of loss tokens (megatron's calculate_per_token_loss). `precision` fp8 adds
    Transformer Engine's FP8 recipe (train.model.precision; bf16 weights)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from train.model.precision import fp8_transformer_kwargs

    s = cfg.resolved()
    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute = {}
    if s.recompute == "selective":  # megatron's default recompute_modules: ["core_attn"]
        recompute = dict(recompute_granularity="selective")
    elif s.recompute == "full":
        k, per_stage = s.recompute_layers_per_stage(pp), s.num_layers // pp
        recompute = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=k) \
            if k < per_stage else dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_heads,
        num_query_groups=s.num_kv_heads, ffn_hidden_size=s.ffn_hidden_size,
        kv_channels=s.kv_channels(),
        normalization="RMSNorm", layernorm_epsilon=s.norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=s.dropout, attention_dropout=s.dropout,
        init_method_std=s.init_std,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, bf16=bf16, pipeline_dtype=dtype,
        # Keeps megatron's own init TP-invariant (full weight drawn, then split) and works on CPU.
        use_cpu_initialization=True,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False, calculate_per_token_loss=per_token_loss,
        no_rope_freq=s.no_rope_layers(), **recompute, **fp8_transformer_kwargs(precision),
        **transformer_kwargs(s.moe, s.ffn_hidden_size, ep),
    )


def layer_spec(use_te: bool | None = None, num_experts: int = 0):
    """Transformer Engine layer spec when TE is installed (and `use_te` is not False), else local. With
    `num_experts` every MLP is an MoE layer (SequentialMLP experts: no grouped GEMM)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = getattr(specs, "HAVE_TE", False)
    moe = dict(num_experts=num_experts, moe_grouped_gemm=False) if num_experts else {}
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm", **moe)


def build_model(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, bf16: bool = False, seed: int = 1234,
                use_te: bool | None = None, per_token_loss: bool = False, precision: str = "fp32") -> list:
    """This rank's GPTModel chunk(s) (a list, one per virtual stage; no virtual stages yet), initialised.

    Needs `parallel_state` initialised with the same TP/PP. Returned unwrapped: DDP and Float16Module
    wrapping is the trainer's job.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    s = cfg.resolved()
    ep = ps.get_expert_model_parallel_world_size() if s.moe.enabled else 1  # parallel.ep (train.model.parallel)
    if s.moe.enabled:
        fix_megatron_without_te()
    tcfg = transformer_config(cfg, tp=tp, pp=pp, bf16=bf16, per_token_loss=per_token_loss, precision=precision,
                              ep=ep)
    model = GPTModel(
        config=tcfg, transformer_layer_spec=layer_spec(use_te, s.moe.num_experts),
        vocab_size=cfg.padded_vocab_size(tp), max_sequence_length=s.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=s.tie_embeddings,
        position_embedding_type="rope", rotary_base=int(s.rope_theta),
    )
    if cfg.init == "layout_invariant":
        init_layout_invariant(model, seed=seed, std=s.init_std, num_layers=s.num_layers)
    return [model]


def _global_name(name: str, layer_offset: int) -> str:
    """`decoder.layers.3.x` on a stage whose first layer is global layer `offset` → global index."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + layer_offset)
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"  # tied: the last stage's copy equals the first's
    return ".".join(parts)


def init_layout_invariant(model, *, seed: int, std: float, num_layers: int) -> None:
    """Draw each full parameter from a generator seeded by (seed, global name), keep this rank's slice.

    Norm weights are ones; output projections (attention proj, MLP fc2) use std / sqrt(2 · layers) as
    Megatron's scaled init does. The full tensor is drawn on CPU, so this costs host time once at start.
    """
    import hashlib

    import torch
    from megatron.core import parallel_state as ps

    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    offset = layer_offset(model)
    experts = getattr(model.config, "num_moe_experts", None) or 0
    ep_rank = ps.get_expert_model_parallel_rank() if experts else 0
    num_local = experts // ps.get_expert_model_parallel_world_size() if experts else 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = global_expert_name(_global_name(name, offset), ep_rank, num_local)
            if "norm" in gname.rsplit(".", 2)[-2] or gname.endswith("layer_norm_weight"):
                p.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(
                (seed * 1_000_003 + int(hashlib.sha1(gname.encode()).hexdigest()[:12], 16)) % (2**63))
            dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
            shape = list(p.shape)
            if dim >= 0:
                shape[dim] *= tp
            scale = std / (2.0 * num_layers) ** 0.5 if gname.endswith(("linear_proj.weight", "linear_fc2.weight")) \
                else std
            full = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
            if dim >= 0:
                full = _tp_slice(full, dim, tp, tp_rank, gated=gname.endswith("linear_fc1.weight"))
            p.copy_(full.to(p.dtype))


def _tp_slice(full, dim: int, tp: int, rank: int, gated: bool):
    """This TP rank's slice. The SwiGLU fc1 weight is [gate; up] stacked, each split separately."""
    import torch

    if not gated:
        return full.chunk(tp, dim=dim)[rank]
    gate, up = full.chunk(2, dim=dim)
    return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)


def layer_offset(model) -> int:
    """Global index of this pipeline stage's first transformer layer."""
    layers = model.decoder.layers
    return (layers[0].layer_number - 1) if len(layers) else 0


def num_parameters(cfg: ModelConfig) -> dict:
    """Parameter counts of the unsharded model (embedding counted once when tied). `active`: the parameters
    one token goes through (MoE: router, top_k routed experts and the shared expert; dense: all of them);
    `moe`: one layer's MLP split into router, routed experts and shared expert (MoE only)."""
    s = cfg.resolved()
    h, f, L = s.hidden_size, s.ffn_hidden_size, s.num_layers
    head = s.kv_channels()
    attn = 2 * h * s.num_heads * head + 2 * h * s.num_kv_heads * head
    mlp = mlp_parameters(s.moe, h, f)
    layer = attn + mlp["total"] + 2 * h
    active_layer = attn + mlp["active"] + 2 * h
    emb = s.vocab_size * h
    embs = emb * (1 if s.tie_embeddings else 2)
    total = L * layer + h + embs
    out = {"total": total, "embedding": emb, "non_embedding": L * layer + h, "per_layer": layer,
           "active": L * active_layer + h + embs, "active_per_layer": active_layer}
    if s.moe.enabled:
        out["moe"] = {k: v for k, v in mlp.items() if k not in ("total", "active")}
    return out
