"""`train ckpt quantize CKPT|HF OUT --scheme int8-weight | int4-weight | gptq | awq`: a Hugging Face folder
with quantized weights that transformers loads (and vLLM, for the GPTQ/AWQ folders), for `train eval --hf`
and `train generate`.

- `int8-weight`: torchao `Int8WeightOnlyConfig` (per-channel symmetric int8 weights, activations stay float)
  through transformers' `TorchAoConfig`; runs on CPU. Saved as safetensors with torchao's tensor subclasses.
- `int4-weight`: on a GPU, torchao `Int4WeightOnlyConfig(group_size)` (bf16, tinygemm's packed tiles, two
  values a byte). torchao 0.18 has no CPU kernel for it (its `plain`/`preshuffled` formats need the mslk
  package, `tile_packed_to_4d` CUDA); on CPU `IntxWeightOnlyConfig(torch.int4, PerGroup(group_size))`
  instead: the same int4 values and group scales, but stored one value per byte (so on disk like int8).
- `gptq`, `awq`: llm-compressor's `oneshot` with `GPTQModifier` / `AWQModifier`, scheme W4A16 (int4
  weights, group 128, lm_head kept), calibrated on `--samples` sequences of the dataset's training split,
  saved as a compressed-tensors folder. Their inference kernels (Marlin / Machete in vLLM and
  compressed-tensors) need an NVIDIA GPU: without CUDA the scheme is refused, saying so.

Embeddings stay in the source's precision (torchao's and llm-compressor's defaults). A checkpoint is first
exported (train.checkpoint.export_hf) to OUT/.source; config.json records `smoltrain_quantize` (scheme,
source, group size).
"""
from __future__ import annotations

import json
import os
import shutil

from train.checkpoint.layout import CheckpointError

SCHEMES = ("int8-weight", "int4-weight", "gptq", "awq")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


class QuantizeError(CheckpointError):
    """A scheme or input that cannot be quantized here; the message says why."""


def refusal(scheme: str) -> str | None:
    """Why `scheme` cannot run on this machine, or None."""
    import torch

    if scheme in ("gptq", "awq") and not torch.cuda.is_available():
        return (f"--scheme {scheme}: llm-compressor's W4A16 folders run on the Marlin/Machete int4 kernels of vLLM "
                "and compressed-tensors, which need an NVIDIA GPU; no CUDA device here. Use int8-weight or "
                "int4-weight (torchao, CPU) or run this on a GPU machine")
    return None


def source_folder(src: str, out: str) -> str:
    """The HF folder to quantize: `src` itself, or the export of the checkpoint `src` into OUT/.source."""
    p = os.path.abspath(src)
    if os.path.isfile(os.path.join(p, "config.json")) and not os.path.isfile(os.path.join(p, "manifest.json")):
        return os.path.abspath(src)
    from train.checkpoint.export_hf import export
    from train.checkpoint.init_from import find_checkpoint

    ckpt = find_checkpoint(src, "CKPT")
    folder = os.path.join(out, ".source")
    export(ckpt, folder)
    return folder


def _torchao_config(scheme: str, group_size: int | None, shape: tuple[int, int]):
    import torch
    from transformers import TorchAoConfig

    if scheme == "int8-weight":
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig()), None
    gs = group_size or (128 if torch.cuda.is_available() else 32)
    for n in shape:
        if n % gs:
            raise QuantizeError(f"--group-size {gs}: does not divide the weights' input size {n} (hidden or FFN); "
                                "give a divisor of both")
    if torch.cuda.is_available():
        from torchao.quantization import Int4WeightOnlyConfig

        return TorchAoConfig(Int4WeightOnlyConfig(group_size=gs, int4_packing_format="tile_packed_to_4d")), gs
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(gs))), gs


def _llmcompressor(folder: str, out: str, scheme: str, dataset: str, samples: int, seq_len: int) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from train.checkpoint.prune import calibration_tokens

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, use_safetensors=True,
                                                 trust_remote_code=False)
    if scheme == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = [GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])]
    else:
        from llmcompressor.modifiers.awq import AWQModifier

        recipe = [AWQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])]
    ids = calibration_tokens(dataset, samples, seq_len)
    calib = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq_len] * samples})
    oneshot(model=model, dataset=calib, recipe=recipe, max_seq_length=seq_len, num_calibration_samples=samples)
    model.save_pretrained(out, save_compressed=True)


def quantize(src: str, out: str, scheme: str, group_size: int | None = None, dataset: str | None = None,
             samples: int = 128, seq_len: int = 512) -> dict:
    """Write the quantized folder OUT; returns its config.json."""
    import torch

    if scheme not in SCHEMES:
        raise QuantizeError(f"--scheme {scheme!r}: one of {', '.join(SCHEMES)}")
    why = refusal(scheme)
    if why:
        raise QuantizeError(why)
    out = os.path.abspath(out)
    if os.path.isfile(os.path.join(out, "config.json")):
        raise QuantizeError(f"{out}: already holds a model; give an empty or new folder")
    from storage import atomic

    with atomic.atomic_dir(out) as out:  # the folder appears complete (storage.atomic)
        folder = source_folder(src, out)
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        gs = None
        if scheme in ("gptq", "awq"):
            if dataset is None:
                raise QuantizeError(f"--scheme {scheme} calibrates: give the dataset with --data")
            _llmcompressor(folder, out, scheme, dataset, samples, seq_len)
        else:
            from transformers import AutoModelForCausalLM

            qc, gs = _torchao_config(scheme, group_size, (cfg["hidden_size"], cfg["intermediate_size"]))
            dtype = torch.bfloat16 if scheme == "int4-weight" and torch.cuda.is_available() else torch.float32
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, quantization_config=qc,
                                                         use_safetensors=True, trust_remote_code=False,
                                                         device_map="cuda" if torch.cuda.is_available() else "cpu")
            model.save_pretrained(out)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(folder, name)) and not os.path.isfile(os.path.join(out, name)):
                shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
        with open(os.path.join(out, "config.json")) as f:
            written = json.load(f)
        written["smoltrain_quantize"] = {"scheme": scheme, "source": os.path.abspath(src), "group_size": gs,
                                         "from_checkpoint": cfg.get("smoltrain_checkpoint")}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(written, f, indent=1)
        if folder == os.path.join(out, ".source"):
            shutil.rmtree(folder)
    return written


def folder_bytes(folder: str) -> int:
    """Bytes of a model folder's weight files (safetensors / bin)."""
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if n.endswith((".safetensors", ".bin")) and os.path.isfile(os.path.join(folder, n)))
