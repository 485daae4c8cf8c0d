"""The `train eval` worker that torchrun starts on every rank: `python -m train.eval.run SPEC.json`.

SPEC (written by `train eval`): {"config": resolved TrainConfig YAML, "checkpoints": [paths],
"labels": [a label or null per checkpoint] or null, "out_dir": folder for one JSON per checkpoint
(OUT/<label>.json for a labeled one, else OUT/<checkpoint name>.json), "tokenizer": path or null}.
The model is built once under the config's TP × PP (× DP from the world size); each checkpoint, of
any run, is loaded into it (megatron dist_checkpointing reshards any saved layout), then evaluated.
Rank 0 writes the results (with "evaluated_at", and "label" for a labeled checkpoint) and prints one
line per checkpoint.
"""
from train.model import cpu_compat
from train.monitor import console

console.quiet(prefix="eval-")  # library warnings → RUN_DIR/logs/eval-rank<RANK>.log (train.monitor.console)
cpu_compat.install()


def main(argv: list[str] | None = None) -> int:
    import json
    import os
    import sys
    import time

    import fsspec

    from storage import config as cfgmod
    from train.model import parallel
    from train.checkpoint import layout
    from train.checkpoint.resume import load_into
    from train.config import TrainConfig
    from train.eval.evaluator import build_evaluator
    from train.eval.results import checkpoint_tokenizer, run_dir_of, write_result
    from train.monitor.metrics import format_eval
    from train.model.gpt import build_model
    from train.state import TrainState

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    # beside the training logs of the first checkpoint's run (the results folder holds only result JSONs)
    run_dir = run_dir_of(spec["checkpoints"][0])
    console.to_file(console.log_path(os.path.join(run_dir or spec["out_dir"], "logs"), prefix="eval-"))
    cfg = cfgmod.load(TrainConfig, spec["config"], [])
    par = parallel.init(cfg)
    try:
        chunks = build_model(cfg.model, tp=par.tp, pp=par.pp, bf16=cfg.precision == "bf16", seed=cfg.seed)
        if cfg.precision == "bf16":
            from megatron.core.transformer.module import Float16Module

            chunks = [Float16Module(c.config, c) for c in chunks]
        dataset = None if cfg.debug.synthetic_data else cfg.data.dataset
        tok = spec.get("tokenizer") or checkpoint_tokenizer(cfg, spec["checkpoints"][0])

        def warn(msg: str) -> None:
            if par.rank == 0:
                print(f"[warning] {msg}", file=sys.stderr, flush=True)

        evaluator = build_evaluator(cfg, chunks, par, tok, dataset, warn=warn)
        labels = spec.get("labels") or [None] * len(spec["checkpoints"])
        for path, label in zip(spec["checkpoints"], labels):
            root, name = os.path.split(os.path.abspath(path.rstrip("/")))
            manifest = layout.read_manifest(fsspec.filesystem("file"), os.path.join(root, name))
            state = TrainState(model=chunks, optimizer=None, scheduler=None, loader=None)
            load_into(state, root, name, cfg.checkpoint, restore_rng=False)
            metrics, details = evaluator.run()
            metrics |= _cost(cfg, chunks, par, manifest, tok)
            if par.rank == 0:
                rec = {"checkpoint": name, "path": os.path.join(root, name), "step": manifest["step"],
                       "consumed_tokens": state.consumed_tokens,
                       "layout": {"tp": par.tp, "pp": par.pp, "dp": par.dp}, "evaluated_at": time.time(),
                       "metrics": metrics, "tasks": details}
                if label:
                    rec = {"label": label, **rec}
                out = write_result(spec["out_dir"], rec)
                print(format_eval({"step": manifest["step"], **metrics}) + f" -> {out}", flush=True)
        return 0
    finally:
        parallel.shutdown()


def _cost(cfg, chunks, par, manifest: dict, tokenizer_path: str | None) -> dict:
    """size_bytes of the weights and, with eval.generation.speed_prompts, generation_tokens_per_s of the
    model's transformers mirror (train.eval.speed); every rank calls it (the mirror is gathered)."""
    from train.eval.speed import checkpoint_bytes, generation_speed

    out = {"size_bytes": checkpoint_bytes(manifest)}
    g = cfg.eval.generation
    if g.speed_prompts and tokenizer_path:
        import torch.distributed as dist

        from train.generation.load import tokenizer_for
        from train.generation.sync import HFMirror

        model = HFMirror(cfg.model).sync(chunks)
        box = [None]
        if par.rank == 0:
            box = [generation_speed(model, tokenizer_for(tokenizer_path)[0], g.speed_prompts, g.speed_new_tokens)]
        dist.broadcast_object_list(box, src=0)
        out["generation_tokens_per_s"] = box[0]
    return out


if __name__ == "__main__":
    from storage.lifecycle import run_main

    run_main(main)
