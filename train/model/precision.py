"""Numeric precision on the model side: whether FP8 can run here, and the megatron TransformerConfig
keywords for it. `train.config` checks `precision: fp8` with `fp8_unsupported_reasons`; `train.model.gpt`
builds the model with `fp8_transformer_kwargs`.
"""
from __future__ import annotations

FP8_MIN_CAPABILITY = (8, 9)


def fp8_unsupported_reasons() -> list[str]:
    """Why FP8 training cannot run in this process: no CUDA GPU, a GPU older than compute capability 8.9,
    Transformer Engine missing (or failing to import), or TE's own FP8 check. Empty when it can."""
    import importlib.util

    import torch

    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA GPU is visible")
    else:
        for i in range(torch.cuda.device_count()):
            cap = tuple(torch.cuda.get_device_capability(i))
            if cap < FP8_MIN_CAPABILITY:
                reasons.append(f"GPU {i} ({torch.cuda.get_device_name(i)}) has compute capability "
                               f"{cap[0]}.{cap[1]}, FP8 needs >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}")
                break
    if importlib.util.find_spec("transformer_engine") is None:
        reasons.append("Transformer Engine is not installed (pip install transformer-engine[pytorch])")
    elif not reasons:
        try:
            import transformer_engine.pytorch  # noqa: F401
            from transformer_engine.pytorch import fp8 as te_fp8
        except Exception as e:  # noqa: BLE001 - a broken TE install is a reason like any other
            reasons.append(f"Transformer Engine fails to import ({type(e).__name__}: {e})")
        else:
            check = getattr(te_fp8, "check_fp8_support", None)
            ok, why = check() if check is not None else (True, "")
            if not ok:
                reasons.append(f"Transformer Engine reports no FP8 support: {why}")
    return reasons


def fp8_transformer_kwargs(precision: str) -> dict:
    """megatron TransformerConfig keywords for `precision` (empty unless fp8): Megatron-LM's
    `--fp8-format hybrid` (E4M3 forward, E5M2 gradients) with delayed scaling over an amax history of
    1024 steps (max), weights kept in bf16 (the FP8 casts happen inside TE's layers). Only meaningful with
    the Transformer Engine layer spec, which check_precision guarantees is available."""
    if precision != "fp8":
        return {}
    return {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_margin": 0, "fp8_amax_history_len": 1024,
            "fp8_amax_compute_algo": "max", "fp8_wgrad": True}
