"""`train ckpt prune CKPT OUT --width hidden=H,ffn=F,heads=N | --depth L`: structured pruning with
Minitron's recipe (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge
Distillation"), written as a normal checkpoint that `--init`, `train eval`, export and distillation take.

NVIDIA ModelOpt's `mtp.prune(model, mode="mcore_minitron")` (0.47.0) does this on a Megatron-core model,
but its Megatron plugin imports Transformer Engine at module import (modelopt/torch/nas/plugins/megatron.py),
which needs CUDA: on this CPU stack (megatron-core 0.16.1, local layer spec) the mode is not even
registered. So the recipe is implemented here, on whole tensors (any input layout: read as the HF export
reads them), with a float32 transformers model of the same weights for the calibration forward passes.

Importance, from activations on calibration sequences (the training split of a dataset, `--samples`
windows of `--seq-len` tokens), each the root mean square over all calibration tokens:
- hidden channel c (`hidden=`): of the outputs of every RMSNorm (both norms of every layer and the final
  one) at channel c, summed over the norms;
- FFN neuron j (`ffn=`), per layer: of the input of down_proj at j (silu(gate)·up);
- attention head h (`heads=`), per layer: of the L2 norm of head h's output (its slice of o_proj's input);
  query heads are pruned within each KV group, the same number in every group, so GQA is kept and every
  layer keeps `heads` heads of the original size (`model.head_dim`);
- layer i (`--depth`): the mean KL(full model ‖ model without layer i) of the next-token distributions over
  the calibration tokens: the change of the output when the layer is dropped. The `L` most important
  layers are kept, in their order.
The most important units are kept (ties: the lower index); all width axes are ranked on the original
model, in one calibration pass (as ModelOpt does). The output has a fresh model config (hidden, ffn,
heads, head_dim, layers) and keeps the input's vocabulary, padding, tokenizer and precision; its
manifest's `meta.prune` records the input, the targets, the calibration data and the kept indices.
"""
from __future__ import annotations

import os

import torch

from train.checkpoint.layout import CheckpointError

WIDTH_KEYS = {"hidden": "hidden_size", "ffn": "ffn_hidden_size", "heads": "num_heads"}


class PruneError(CheckpointError):
    """Arguments or inputs that cannot be pruned; the message says which."""


def parse_width(spec: str) -> dict[str, int]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        k, _, v = part.partition("=")
        if k not in WIDTH_KEYS or not v.isdigit() or int(v) < 1:
            raise PruneError(f"--width: {part!r} is not KEY=N with KEY one of {', '.join(WIDTH_KEYS)} and N >= 1")
        out[k] = int(v)
    if not out:
        raise PruneError("--width: give at least one of hidden=N, ffn=N, heads=N")
    return out


def top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, ascending (ties: the lower index)."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return torch.tensor(sorted(order[:k]), dtype=torch.long)


def calibration_tokens(dataset: str, samples: int, seq_len: int) -> torch.Tensor:
    """[samples, seq_len] windows of the training split (documents concatenated in manifest order)."""
    import numpy as np

    from storage.dataset import iter_documents
    from storage.manifest import read_manifest

    man = read_manifest(dataset)
    shards = [sh for s in man.sources.values() if s.kind in ("text", "chat") for sh in s.shards]
    need, parts, have = samples * seq_len, [], 0
    for _, toks in iter_documents(dataset, shards):
        parts.append(np.asarray(toks, dtype=np.int64))
        have += len(toks)
        if have >= need:
            break
    if have < need:
        raise PruneError(f"{dataset}: {have} training tokens, fewer than --samples {samples} × --seq-len {seq_len}")
    return torch.from_numpy(np.concatenate(parts)[:need].reshape(samples, seq_len))


def causal_lm(config: dict, weights: dict):
    """A float32 transformers causal LM from an export config and Llama-named tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in config.items() if k not in ("smoltrain_checkpoint", "torch_dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def activation_importance(model, tokens: torch.Tensor, batch: int = 8) -> dict[str, torch.Tensor]:
    """{"hidden": [h], "ffn": [layers, ffn], "heads": [layers, heads]}: the RMS of each unit's activation over
    every calibration token (heads: of its output's L2 norm), see the module doc."""
    cfg = model.config
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    sums = {"hidden": torch.zeros(cfg.hidden_size, dtype=torch.float64),
            "ffn": torch.zeros(cfg.num_hidden_layers, cfg.intermediate_size, dtype=torch.float64),
            "heads": torch.zeros(cfg.num_hidden_layers, heads, dtype=torch.float64)}
    norms = {}
    hooks = []

    def norm_hook(name):
        def f(mod, inp, out):
            norms[name] = norms.get(name, 0) + out.double().pow(2).reshape(-1, out.shape[-1]).sum(0)
        return f

    def fc2_hook(i):
        def f(mod, inp):
            sums["ffn"][i] += inp[0].double().pow(2).reshape(-1, inp[0].shape[-1]).sum(0)
        return f

    def o_hook(i):
        def f(mod, inp):
            x = inp[0].double().reshape(-1, heads, hd)
            sums["heads"][i] += x.norm(dim=-1).pow(2).sum(0)
        return f

    for i, layer in enumerate(model.model.layers):
        hooks += [layer.input_layernorm.register_forward_hook(norm_hook(f"{i}.in")),
                  layer.post_attention_layernorm.register_forward_hook(norm_hook(f"{i}.post")),
                  layer.mlp.down_proj.register_forward_pre_hook(fc2_hook(i)),
                  layer.self_attn.o_proj.register_forward_pre_hook(o_hook(i))]
    hooks.append(model.model.norm.register_forward_hook(norm_hook("final")))
    try:
        for b in tokens.split(batch):
            model.model(input_ids=b, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    n = tokens.numel()
    sums["hidden"] = sum((v / n).sqrt() for v in norms.values())
    sums["ffn"] = (sums["ffn"] / n).sqrt()
    sums["heads"] = (sums["heads"] / n).sqrt()
    return sums


@torch.no_grad()
def layer_importance(model, tokens: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """[layers]: mean KL(full ‖ without layer i) of the next-token distributions over the calibration tokens."""
    layers = model.model.layers
    full = [torch.log_softmax(model(input_ids=b, use_cache=False).logits.double(), -1) for b in tokens.split(batch)]
    out = torch.zeros(len(layers), dtype=torch.float64)
    try:
        for i in range(len(layers)):
            model.model.layers = torch.nn.ModuleList([m for j, m in enumerate(layers) if j != i])
            kl = 0.0
            for b, lp in zip(tokens.split(batch), full):
                lq = torch.log_softmax(model(input_ids=b, use_cache=False).logits.double(), -1)
                kl += float((lp.exp() * (lp - lq)).sum())
            out[i] = kl / tokens.numel()
    finally:
        model.model.layers = layers
    return out


def check_width(shape: dict, target: dict) -> tuple[int, int, int]:
    """(hidden, ffn, heads) after pruning; refused when larger than the model's or heads not a multiple of
    the KV heads."""
    heads, kv = shape["num_heads"], shape["num_kv_heads"]
    h_new, f_new, n_new = (target.get("hidden", shape["hidden_size"]), target.get("ffn", shape["ffn_hidden_size"]),
                           target.get("heads", heads))
    for k, new, old in (("hidden", h_new, shape["hidden_size"]), ("ffn", f_new, shape["ffn_hidden_size"]),
                        ("heads", n_new, heads)):
        if new > old:
            raise PruneError(f"--width {k}={new}: larger than the model's {old}")
    if n_new % kv:
        raise PruneError(f"--width heads={n_new}: must be a multiple of the {kv} KV heads (query heads are pruned "
                         "within each KV group, the same number in each)")
    return h_new, f_new, n_new


def prune_width(hf: dict, shape: dict, imp: dict, target: dict) -> tuple[dict, dict, dict]:
    """(pruned Llama tensors, new shape, kept indices) for width targets {hidden, ffn, heads}."""
    L = shape["num_layers"]
    heads, kv = shape["num_heads"], shape["num_kv_heads"]
    hd = shape.get("head_dim") or shape["hidden_size"] // heads
    per = heads // kv
    h_new, f_new, n_new = check_width(shape, target)
    keep_h = top(imp["hidden"], h_new)
    keep_f = [top(imp["ffn"][i], f_new) for i in range(L)]
    keep_q = [torch.cat([g * per + top(imp["heads"][i, g * per:(g + 1) * per], n_new // kv) for g in range(kv)])
              for i in range(L)]
    out = {}
    for k, t in hf.items():
        t = t.clone()
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            t = t[:, keep_h]
        elif k.endswith("norm.weight"):
            t = t[keep_h]
        else:
            i = int(k.split(".")[2])
            if k.endswith("q_proj.weight"):
                rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in keep_q[i].tolist()])
                t = t[rows][:, keep_h]
            elif k.endswith(("k_proj.weight", "v_proj.weight")):
                t = t[:, keep_h]
            elif k.endswith("o_proj.weight"):
                cols = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in keep_q[i].tolist()])
                t = t[keep_h][:, cols]
            elif k.endswith(("gate_proj.weight", "up_proj.weight")):
                t = t[keep_f[i]][:, keep_h]
            elif k.endswith("down_proj.weight"):
                t = t[keep_h][:, keep_f[i]]
            else:
                raise PruneError(f"tensor {k!r}: no pruning rule")
        out[k] = t.contiguous()
    new = {**shape, "hidden_size": h_new, "ffn_hidden_size": f_new, "num_heads": n_new,
           "head_dim": None if h_new == n_new * hd else hd}
    kept = {"hidden": keep_h.tolist(), "ffn": [x.tolist() for x in keep_f], "heads": [x.tolist() for x in keep_q]}
    return out, new, kept


def prune_depth(hf: dict, shape: dict, imp: torch.Tensor, layers: int) -> tuple[dict, dict, list[int]]:
    keep = top(imp, layers).tolist()
    out = {}
    for k, t in hf.items():
        if k.startswith("model.layers."):
            i = int(k.split(".")[2])
            if i in keep:
                out[f"model.layers.{keep.index(i)}." + k.split(".", 3)[3]] = t
        else:
            out[k] = t
    return out, {**shape, "num_layers": layers}, keep


def run_plan(plan: dict, out_root: str, write) -> str:
    """In the worker: calibrate, rank, prune and write with `write` (import_worker.write_checkpoint)."""
    from train.checkpoint.export_hf import llama_weights

    torch.manual_seed(0)
    hf, config, m = llama_weights(plan["checkpoint"])
    shape = plan["shape"]
    dtype = next(iter(hf.values())).dtype
    model = causal_lm(config, hf)
    tokens = calibration_tokens(plan["dataset"], plan["samples"], plan["seq_len"])
    record = {k: plan[k] for k in ("checkpoint", "width", "depth", "dataset", "samples", "seq_len")}
    if plan["depth"]:
        imp = layer_importance(model, tokens)
        hf, shape, kept = prune_depth(hf, shape, imp, plan["depth"])
        record |= {"layer_importance": imp.tolist(), "kept_layers": kept}
    else:
        imp = activation_importance(model, tokens)
        hf, shape, kept = prune_width(hf, shape, imp, plan["width"])
        record["kept"] = kept
    hf = {k: v.to(dtype) for k, v in hf.items()}
    return write(hf, shape, out_root, {**plan["meta"], "prune": record}, carry=plan["carry"])


def prune(ckpt: str, out_root: str, width: str | None, depth: int | None, dataset: str | None = None,
          samples: int = 256, seq_len: int | None = None, timeout: float | None = None) -> str:
    """Prune checkpoint `ckpt` into OUT_ROOT/step_00000000; returns its path. Checked here first; the work
    runs in the import worker (a subprocess: megatron writes the checkpoint)."""
    import fsspec

    from train.checkpoint import layout
    from train.checkpoint.export_hf import carried_dir
    from train.checkpoint.init_from import find_checkpoint
    from train.checkpoint.merge import _output_shape, run_worker

    if (width is None) == (depth is None):
        raise PruneError("give --width hidden=..,ffn=..,heads=.. or --depth N (one of them)")
    target = parse_width(width) if width else None
    ckpt = find_checkpoint(ckpt, "checkpoint")
    out_root = os.path.abspath(out_root)
    if os.path.isdir(out_root) and any(n.startswith("step_") for n in os.listdir(out_root)):
        raise PruneError(f"{out_root}: already holds checkpoints; give an empty or new folder")
    m = layout.read_manifest(fsspec.filesystem("file"), ckpt)
    meta = m.get("meta") or {}
    if dataset is None:
        tok = meta.get("tokenizer") or ""
        dataset = os.path.dirname(tok) if os.path.isfile(os.path.join(os.path.dirname(tok), "manifest.json")) else None
        if dataset is None:
            raise PruneError(f"{ckpt}: records no dataset; give the calibration data with --data DATASET")
    shape = _output_shape(ckpt, m)
    if target:
        check_width(shape, target)
    elif not 1 <= depth <= shape["num_layers"] or shape.get("no_rope_every"):
        raise PruneError(f"--depth {depth}: must be 1..{shape['num_layers']} (the model's layers), and the model "
                         "without NoPE layers (model.no_rope_every), whose places would move")
    plan = {"checkpoint": ckpt, "width": target, "depth": depth, "dataset": dataset, "samples": samples,
            "seq_len": seq_len or int(meta.get("seq_len") or 256), "shape": shape,
            "meta": {k: meta[k] for k in ("seq_len", "tokenizer", "hf") if meta.get(k)},
            "carry": carried_dir(ckpt, m)}
    return run_worker("--prune", out_root, plan, timeout, PruneError, "pruning")
