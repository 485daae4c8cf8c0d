"""The process `train ckpt import`, `merge` and `prune` start: writes Hugging Face-named tensors and a
model config as a smoltrain checkpoint.

- `python -m train.checkpoint.import_worker HF_FOLDER OUT_ROOT`: import a HF Llama or SmolLM3 folder;
- `python -m train.checkpoint.import_worker --merge OUT_ROOT` (plan as JSON on stdin, from
  train.checkpoint.merge): the weighted average of checkpoints;
- `python -m train.checkpoint.import_worker --prune OUT_ROOT` (plan as JSON on stdin, from
  train.checkpoint.prune): a structurally pruned checkpoint.

Both go through `write_checkpoint`: build the model (TP1 PP1, one gloo process), copy the tensors into its
parameters, save it with the trainer's CheckpointManager (a full, synchronous save at step 0, no
optimizer), then add tokenizer/config files under `hf/` to the committed checkpoint and its manifest; all
of it in `.tmp-<name>` beside OUT_ROOT, renamed to OUT_ROOT at the end (storage.atomic).
Prints the checkpoint path last; a refused input exits 2 with `error: <why>` as its last line. The CPU
layer is installed at import and the work runs under the `__main__` guard, as for train.run (the
checkpoint writer's helper process re-imports this).
"""
from train.model import cpu_compat

cpu_compat.install()


def _add_carried_files(ckpt: str, folder: str) -> list[str]:
    """Copy the carried files into CKPT/hf/ and list them (size + xxh3_128) in its manifest."""
    import json
    import os
    import shutil

    import fsspec

    from storage import atomic
    from train.checkpoint import layout
    from train.checkpoint.import_hf import CARRIED, HF_DIR

    os.makedirs(os.path.join(ckpt, HF_DIR), exist_ok=True)
    m = layout.read_manifest(fsspec.filesystem("file"), ckpt)
    names = []
    for name in CARRIED:
        src = os.path.join(folder, name)
        if os.path.isfile(src):
            dst = os.path.join(ckpt, HF_DIR, name)
            shutil.copyfile(src, dst)
            size, digest = layout.checksum_file(fsspec.filesystem("file"), dst, fsync=True)
            m["files"][f"{HF_DIR}/{name}"] = {"size": size, "xxh3_128": digest}
            names.append(name)
    atomic.write_bytes(os.path.join(ckpt, layout.MANIFEST), json.dumps(m, indent=1).encode())
    return names


def write_checkpoint(hf: dict, shape: dict, out_root: str, meta: dict, carry: str | None = None) -> str:
    """Write HF Llama-named tensors `hf` (one dtype: bf16 stays bf16, else fp32) as the TP1 PP1 model of
    `shape` (train.model.gpt.ModelConfig keys) into OUT_ROOT/step_00000000 (+ `latest`); returns its path.
    The manifest's meta is {model, precision, padded_vocab_size, seq_len} updated with `meta`; with
    `carry`, that folder's tokenizer/config files are copied into `hf/` (meta `hf.dir` says so)."""
    import os
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from storage import atomic
    from train.checkpoint import CheckpointConfig, CheckpointManager, layout
    from train.checkpoint.import_hf import dtype_precision, megatron_params
    from train.model.gpt import ModelConfig, build_model
    from train.state import TrainState

    dtype, precision = dtype_precision(hf)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        mcfg = ModelConfig(**{**shape, "init": "megatron"})
        chunks = build_model(mcfg, bf16=dtype == "bfloat16")
        if dtype == "bfloat16":  # as the trainer's bf16 runs: every parameter (norms too) in bf16
            from megatron.core.transformer.module import Float16Module

            chunks = [Float16Module(c.config, c).module for c in chunks]
        if "score.weight" in hf:  # a reward model (LlamaForSequenceClassification)
            from train.model.heads import attach

            attach(chunks[0], "reward_head", seed=0, replace=True)
        params = dict(chunks[0].named_parameters())
        values = megatron_params(hf, shape, list(params))
        with torch.no_grad():
            for name, p in params.items():
                v = values[name]
                if tuple(v.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: Hugging Face tensor has shape {tuple(v.shape)}, the model "
                                     f"{tuple(p.shape)}")
                p.copy_(v.to(p.dtype))
        meta = {"model": shape, "precision": precision, "padded_vocab_size": mcfg.padded_vocab_size(1),
                "seq_len": min(2048, mcfg.resolved().max_position_embeddings), **meta}
        with atomic.atomic_dir(out_root) as tmp_root:  # OUT_ROOT appears whole, carried files included
            cfg = CheckpointConfig(dir=tmp_root, async_save=False, full_every=0, incremental_every=0,
                                   keep_last=1_000_000)
            mgr = CheckpointManager(cfg, tmp_root, meta=meta)
            state = TrainState(model=chunks, optimizer=None, scheduler=None, loader=None)
            mgr.maybe_save(state, force=True)
            mgr.close()
            if mgr.failed:
                raise RuntimeError("; ".join(mgr.failed))
            if carry:
                _add_carried_files(os.path.join(tmp_root, layout.ckpt_name(0)), carry)
        return os.path.join(out_root, layout.ckpt_name(0))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def import_main(folder: str, out_root: str) -> str:
    from train.checkpoint.import_hf import HF_DIR, dtype_precision, load_tensors, read_config

    shape = read_config(folder)
    hf = load_tensors(folder)
    dtype, _ = dtype_precision(hf)
    return write_checkpoint(hf, shape, out_root, {"hf": {"source": folder, "dtype": dtype, "dir": HF_DIR}},
                            carry=folder)


def main(argv: list[str]) -> int:
    import json
    import sys

    from train.checkpoint.layout import CheckpointError

    try:
        if argv[0] in ("--merge", "--prune"):
            from train.checkpoint import merge, prune

            ckpt = (merge if argv[0] == "--merge" else prune).run_plan(json.load(sys.stdin), argv[1], write_checkpoint)
        else:
            ckpt = import_main(*argv)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(ckpt, flush=True)
    return 0


if __name__ == "__main__":
    import sys

    from storage.lifecycle import run_main

    run_main(lambda: main(sys.argv[1:]))
