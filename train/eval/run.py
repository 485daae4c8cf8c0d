"""The `train eval` worker that torchrun starts on every rank: `python -m train.eval.run SPEC.json`.

SPEC (written by `train eval`): {"config": resolved TrainConfig YAML, "checkpoints": [paths],
"out_dir": folder for one JSON per checkpoint}. The model is built once under the config's TP × PP
(× DP from the world size); each checkpoint is loaded into it (megatron dist_checkpointing reshards
any saved layout), then evaluated. Rank 0 writes the results and prints one line per checkpoint.
"""
import warnings

from train import cpu_compat

cpu_compat.install()
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
warnings.filterwarnings("ignore", message=r".*cuda_graph_scope")


def main(argv: list[str] | None = None) -> int:
    import json
    import os
    import sys

    import fsspec

    from storage import config as cfgmod
    from train import parallel
    from train.checkpoint import layout
    from train.checkpoint.resume import load_into
    from train.config import TrainConfig
    from train.eval.evaluator import build_evaluator
    from train.eval.results import checkpoint_tokenizer, write_result
    from train.metrics import format_eval
    from train.models import build_model
    from train.state import TrainState

    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
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
        for path in spec["checkpoints"]:
            root, name = os.path.split(os.path.abspath(path.rstrip("/")))
            manifest = layout.read_manifest(fsspec.filesystem("file"), os.path.join(root, name))
            state = TrainState(model=chunks, optimizer=None, scheduler=None, loader=None)
            load_into(state, root, name, cfg.checkpoint, restore_rng=False)
            metrics, details = evaluator.run()
            if par.rank == 0:
                rec = {"checkpoint": name, "path": os.path.join(root, name), "step": manifest["step"],
                       "consumed_tokens": state.consumed_tokens,
                       "layout": {"tp": par.tp, "pp": par.pp, "dp": par.dp}, "metrics": metrics, "tasks": details}
                out = write_result(spec["out_dir"], rec)
                print(format_eval({"step": manifest["step"], **metrics}) + f" -> {out}", flush=True)
        return 0
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
