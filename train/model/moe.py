"""Mixture of experts: the `model.moe` config section and what it means for megatron-core and parameter counts.

`model.moe.num_experts: 0` (the default) is a dense model. Otherwise every layer's MLP is megatron-core's
MoELayer: a router (a linear h → E, softmax or sigmoid scores, top-k), E routed experts (SwiGLU MLPs of
`ffn_hidden_size`, SequentialMLP on the local spec: plain linears, which run on CPU) and optionally one shared
expert every token goes through (`shared_expert_ffn_hidden_size`, megatron's
moe_shared_expert_intermediate_size). Routed experts are split over `parallel.ep` ranks (expert parallelism
over the data-parallel ranks); tokens reach them through megatron's token dispatcher (alltoall or allgather).

Router scores (`pre_softmax`): false (Mixtral, Qwen3-MoE with norm_topk_prob): top-k of the logits, then a
softmax over the k chosen; true (OLMoE, norm_topk_prob false): softmax over all experts, then top-k.
Load balancing (`load_balancing`): `aux_loss` (Switch: over the micro-batch), `seq_aux_loss` (per sequence,
DeepSeek-V2), `none`; scaled by `aux_loss_coeff`. `z_loss_coeff` > 0 adds the router z-loss (ST-MoE).
`capacity_factor`: null keeps every token; a number drops tokens beyond capacity_factor × tokens · k / E per
expert (megatron's moe_expert_capacity_factor, probs policy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from storage.config import ConfigError

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")


@dataclass
class MoEConfig:
    """`model.moe`: routed experts in every layer's MLP (0 experts: dense)."""
    num_experts: int = 0             # routed experts per layer; 0: a dense model (every other key unused)
    top_k: int = 2                   # experts each token is sent to
    ffn_hidden_size: int | None = None  # one expert's SwiGLU hidden size; null: model.ffn_hidden_size
    shared_expert_ffn_hidden_size: int = 0  # hidden size of the shared expert every token also goes through; 0: none
    score_function: Literal["softmax", "sigmoid"] = "softmax"  # router scores (megatron moe_router_score_function)
    pre_softmax: bool = False        # true: softmax over all experts, then top-k (OLMoE); false: top-k, then softmax over them (Mixtral, Qwen3-MoE)
    load_balancing: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"  # megatron moe_router_load_balancing_type
    aux_loss_coeff: float = 0.01     # weight of the load-balancing loss
    z_loss_coeff: float = 0.0        # weight of the router z-loss; 0: off
    capacity_factor: float | None = None  # null: no token dropping; else tokens beyond this × the even share per expert are dropped
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"  # megatron moe_token_dispatcher_type

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def validate(self) -> None:
        if self.num_experts < 0:
            raise ConfigError(f"key 'model.moe.num_experts': must be >= 0 (0: dense), got {self.num_experts}")
        if not self.enabled:
            return
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"key 'model.moe.top_k': must be 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ConfigError(f"key 'model.moe.ffn_hidden_size': must be positive or null, got {self.ffn_hidden_size}")
        if self.shared_expert_ffn_hidden_size < 0:
            raise ConfigError("key 'model.moe.shared_expert_ffn_hidden_size': must be >= 0 (0: no shared expert), "
                              f"got {self.shared_expert_ffn_hidden_size}")
        if self.score_function not in ("softmax", "sigmoid"):
            raise ConfigError(f"key 'model.moe.score_function': softmax or sigmoid, got {self.score_function!r}")
        if self.load_balancing not in LOAD_BALANCING:
            raise ConfigError(f"key 'model.moe.load_balancing': one of {', '.join(LOAD_BALANCING)}, "
                              f"got {self.load_balancing!r}")
        if self.token_dispatcher not in DISPATCHERS:
            raise ConfigError(f"key 'model.moe.token_dispatcher': one of {', '.join(DISPATCHERS)}, "
                              f"got {self.token_dispatcher!r}")
        for k in ("aux_loss_coeff", "z_loss_coeff"):
            if getattr(self, k) < 0:
                raise ConfigError(f"key 'model.moe.{k}': must be >= 0, got {getattr(self, k)}")
        if self.load_balancing == "none" and self.aux_loss_coeff > 0:
            raise ConfigError(f"key 'model.moe.aux_loss_coeff': {self.aux_loss_coeff} with load_balancing none; "
                              "set it to 0 or choose aux_loss / seq_aux_loss")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"key 'model.moe.capacity_factor': must be > 0 or null (no dropping), "
                              f"got {self.capacity_factor}")

    def expert_ffn(self, dense_ffn: int) -> int:
        return self.ffn_hidden_size or dense_ffn


def transformer_kwargs(moe: MoEConfig, dense_ffn: int, ep: int = 1) -> dict:
    """megatron TransformerConfig arguments for `moe` (none for a dense model). Grouped GEMM (CUDA) stays off:
    SequentialMLP runs everywhere; router scores in fp32."""
    if not moe.enabled:
        return {}
    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.expert_ffn(dense_ffn),
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_router_score_function=moe.score_function, moe_router_pre_softmax=moe.pre_softmax,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff if moe.load_balancing != "none" else 0.0,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_dispatcher_type=moe.token_dispatcher, moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_dtype="fp32", expert_model_parallel_size=ep,
    )


def layout_problem(moe: MoEConfig, tp: int, ep: int, dp: int | None = None) -> str | None:
    """Why megatron-core cannot run this MoE layout here (an error naming the key), or None."""
    if not moe.enabled:
        return "key 'parallel.ep': expert parallelism needs model.moe.num_experts > 0" if ep > 1 else None
    if tp > 1:
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None and importlib.util.find_spec("apex") is None:
            return (f"key 'parallel.tp': MoE with tp {tp} needs sequence parallelism (megatron-core's MoE layer "
                    "refuses TP > 1 without it in training), which needs Transformer Engine or Apex, absent here; "
                    "use tp 1 with parallel.ep over the data-parallel ranks")
        return (f"key 'parallel.tp': MoE with tp {tp} needs sequence parallelism, which this trainer does not "
                "turn on yet; use tp 1 with parallel.ep")
    if moe.num_experts % ep:
        return f"key 'parallel.ep': {ep} must divide model.moe.num_experts ({moe.num_experts})"
    if dp is not None and dp % ep:
        return f"key 'parallel.ep': {ep} must divide the data-parallel size ({dp}): experts are split over DP ranks"
    return None


def fix_megatron_without_te() -> None:
    """megatron-core 0.16.1 without Transformer Engine: the router's gating linear
    (moe_utils.RouterGatingLinearFunction) tests `te_general_gemm is not None`, a name only its TE import
    defines, so every MoE forward raises NameError; define it as None (plain matmul) when absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """`...mlp.experts.local_experts.j.x` on EP rank r → the global expert `r · num_local + j`, so every EP
    layout draws an expert's weights from the same seed."""
    marker = ".local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker, 1)
    j, rest = tail.split(".", 1)
    return f"{head}{marker}{ep_rank * num_local + int(j)}.{rest}"


def mlp_parameters(moe: MoEConfig, h: int, dense_ffn: int) -> dict:
    """Parameters of one layer's MLP: total and active per token (router, routed experts, shared expert)."""
    if not moe.enabled:
        return {"total": 3 * h * dense_ffn, "active": 3 * h * dense_ffn}
    expert = 3 * h * moe.expert_ffn(dense_ffn)
    shared = 3 * h * moe.shared_expert_ffn_hidden_size
    router = h * moe.num_experts
    return {"total": router + moe.num_experts * expert + shared, "active": router + moe.top_k * expert + shared,
            "router": router, "experts": moe.num_experts * expert, "shared": shared}


def mlp_matmul_params(moe: MoEConfig, h: int, dense_ffn: int) -> int:
    """Matmul parameters a token goes through in one layer's MLP (FLOPs per token: router, k experts, shared)."""
    return mlp_parameters(moe, h, dense_ffn)["active"]
