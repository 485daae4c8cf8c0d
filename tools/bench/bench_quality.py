"""Model-based quality, end to end on real text (tools/bench/quality_corpus.py: the Python documentation's
prose against boilerplate-heavy pages of Debian's documentation), in one run:

1. classifiers: `datapipe classifier train` of a fastText classifier (DCLM's recipe: bigrams, `hq` vs `lq`)
   with scikit-learn's TF-IDF + logistic regression on the same held-out split (`--baseline`); after the
   ablation, the embedding head (FineWeb-Edu's recipe) on a frozen local encoder: the ablation's
   baseline model of seed 1, exported to Hugging Face (`train ckpt export`), mean-pooled.
2. parity and speed: our `classifier` filter against datatrove's `FastTextClassifierFilter` on the same
   model and documents (the ablation's training source): scores and keep decisions, and documents per
   CPU-second of each filter's `run` over the same documents (medians of --runs alternating runs).
3. ablation: `train ablate` with two variants of one build config of the mixed source, `random` (no
   filter: the run reads an equal-token random subset of the whole source) and `classifier` (the fastText
   classifier keeping the top --keep-top share), --seeds seeds each, scored on held-out prose.
Appends a section to docs/benchmarks-history.md unless --no-write.

    python tools/bench/bench_quality.py [--runs 5] [--seeds 3] [--tokens 600000] [--keep-top 0.3] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.bench import history  # noqa: E402
from tools.bench import quality_corpus as qc  # noqa: E402

BIN = Path(sys.executable).parent
ENV = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def sh(*cmd: str, cwd: Path | None = None) -> str:
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(list(cmd), cwd=cwd, env=ENV, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def train_classifier(root: Path, labels: Path, kind: str, *extra: str) -> dict:
    out = root / f"clf-{kind}"
    sh(str(BIN / "datapipe"), "classifier", "train", "--kind", kind, "--data", str(labels), "--output", str(out),
       "--seed", "1", "--holdout", "0.2", "--baseline", *extra)
    return json.loads((out / "eval.json").read_text())


def parity_and_speed(model: Path, docs: list[dict], runs: int) -> dict:
    import hashlib

    from datatrove.data import Document
    from datatrove.pipeline.filters import FastTextClassifierFilter

    from datapipe.quality.qfilter import ClassifierFilter

    # datatrove caches a model by its file name: a name from the content keeps stale copies out
    named = model.parent / f"dt-{hashlib.sha256(model.read_bytes()).hexdigest()[:16]}.bin"
    shutil.copyfile(model, named)
    theirs = FastTextClassifierFilter(str(named), keep_labels=("hq", 0.5), newline_replacement=" ")
    ours = ClassifierFilter({"model": str(model), "threshold": 0.5, "newline_replacement": " "}, "0_classifier")

    def one(flt, key):
        batch = [Document(text=d["text"], id=d["id"]) for d in docs]
        t = time.process_time()
        kept = {d.id for d in flt.run(iter(batch))}
        return time.process_time() - t, kept, [d.metadata[key] for d in batch]

    one(theirs, "__label__hq"), one(ours, "quality_score")  # load both models outside the timing
    t_ours, t_theirs = [], []
    for _ in range(runs):
        dt, kept_t, scores_t = one(theirs, "__label__hq")
        t_theirs.append(dt)
        dt, kept_o, scores_o = one(ours, "quality_score")
        t_ours.append(dt)
    same_scores = sum(a == b for a, b in zip(scores_o, scores_t))
    return {"docs": len(docs), "same_scores": same_scores, "same_decisions": len(kept_o ^ kept_t) == 0,
            "kept": len(kept_o), "ours_docs_per_cpu_s": len(docs) / statistics.median(t_ours),
            "theirs_docs_per_cpu_s": len(docs) / statistics.median(t_theirs),
            "ratio": statistics.median(t_theirs) / statistics.median(t_ours)}


def ablation(root: Path, train_docs: Path, heldout: Path, model: Path, args) -> dict:
    common = {"langid": {"enabled": False}, "shards": {"block_tokens": 65536, "shard_blocks": 8}}
    files = {
        "build": {**common, "tokenizer": {"vocab_size": 8192}, "validation": {"fraction": 0.01},
                  "sources": [{"name": "web", "paths": [str(train_docs)], "filters": []}]},
        "val": {**common, "validation": {"fraction": 0.5},
                "sources": [{"name": "prose", "paths": [str(heldout)], "filters": []}]},
        "train": {"model": {"preset": "tiny"}, "data": {"seq_len": 256},
                  "parallel": {"micro_batch_size": 16, "global_batch_size": 16},
                  "optim": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 10, "schedule": "cosine"},
                  "monitor": {"log_every": 25, "tensorboard": False},
                  "checkpoint": {"full_every": 0, "incremental_every": 0}},
        "ablation": {"output": "out", "build": "build.yaml", "train": "train.yaml", "tokens": args.tokens,
                     "seeds": list(range(1, args.seeds + 1)), "baseline": "random",
                     "variants": {"random": {}, "classifier": {"sources.0.filters": [
                         {"type": "classifier", "params": {"model": str(model), "keep_top": args.keep_top}}]}},
                     "validation": {"prose": "val.yaml"}, "validation_tokens": 65536, "tasks": [],
                     "metrics": ["val/prose/loss", "val/prose/bpb"], "nproc": 1},
    }
    for name, data in files.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    t = time.time()
    out = sh(str(BIN / "train"), "ablate", "ablation.yaml", "--jobs", "2", cwd=root)
    print(out, flush=True)
    report = json.loads((root / "out" / "report.json").read_text())
    manifest = json.loads((root / "out" / "data" / "classifier" / "manifest.json").read_text())
    base = json.loads((root / "out" / "data" / "random" / "manifest.json").read_text())
    return {"report": report, "stdout": out, "wall_s": time.time() - t,
            "quality": manifest["sources"]["web"].get("quality"),
            "tokens_classifier": manifest["sources"]["web"].get("tokens"),
            "tokens_random": base["sources"]["web"].get("tokens")}


def prose_share(docs_path: Path, model: Path, keep_top: float) -> dict:
    """The share of prose documents in the whole training source and in the top `keep_top` by score."""
    from datapipe.quality.fasttext_clf import score_texts

    docs = [json.loads(line) for line in docs_path.read_text().splitlines()]
    scores = score_texts(str(model), [d["text"] for d in docs])
    ranked = sorted(zip(scores, docs), key=lambda p: -p[0])[:max(1, round(keep_top * len(docs)))]
    return {"all": sum(d["id"].startswith("pydoc/") for d in docs) / len(docs),
            "top": sum(d["id"].startswith("pydoc/") for _, d in ranked) / len(ranked)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=600_000)
    ap.add_argument("--keep-top", type=float, default=0.3)
    ap.add_argument("--per-class", type=int, default=1500, help="labelled documents per class, at most")
    ap.add_argument("--boilerplate", type=int, default=3000, help="boilerplate documents in the training source")
    ap.add_argument("--out", default=None, help="working folder (default: a temporary one, removed)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import tempfile

    root = Path(args.out or tempfile.mkdtemp(prefix="bench-quality-"))
    root.mkdir(parents=True, exist_ok=True)
    parts = qc.parts(args.per_class)
    prose = [d for d in parts["train"] if d["kind"] == "prose"]
    boiler = [d for d in parts["train"] if d["kind"] != "prose"][:args.boilerplate]
    train_docs = qc.write_jsonl(root / "in" / "web.jsonl", sorted(prose + boiler, key=lambda d: d["id"]))
    heldout = qc.write_jsonl(root / "in" / "heldout.jsonl", parts["heldout"])
    labels = qc.write_jsonl(root / "in" / "labels.jsonl", parts["label"], label=True)
    print(f"labelled {len(parts['label'])}, training source {len(prose)} prose + {len(boiler)} boilerplate, "
          f"held-out prose {len(parts['heldout'])}", flush=True)
    ft = train_classifier(root, labels, "fasttext", "--bucket", "200000")
    model = root / "clf-fasttext" / "model.bin"
    docs = [json.loads(line) for line in train_docs.read_text().splitlines()]
    speed = parity_and_speed(model, docs, args.runs)
    print(json.dumps(speed), flush=True)
    share = prose_share(train_docs, model, args.keep_top)
    abl = ablation(root, train_docs, heldout, model, args)
    encoder = root / "encoder"
    ckpt = root / "out" / "runs" / "random" / "seed1" / "checkpoints"
    newest = sorted(p for p in ckpt.iterdir() if p.name.startswith("step_"))[-1]
    sh(str(BIN / "train"), "ckpt", "export", str(newest), str(encoder), cwd=root)  # the run's relative paths
    emb = train_classifier(root, labels, "embedding", "--encoder", str(encoder), "--max-length", "256")
    result = {"fasttext": ft, "embedding": emb, "speed": speed, "share": share, "ablation": abl}
    (root / "result.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"result: {root / 'result.json'}")
    if not args.no_write:
        write_section(result, args, len(parts["label"]))
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def write_section(r: dict, args, n_labels: int) -> None:
    ft, emb, sp, abl = r["fasttext"], r["embedding"], r["speed"], r["ablation"]
    rep = abl["report"]
    lines = ["", f"## Quality classifiers and the ablation that proves them ({datetime.date.today().isoformat()}, "
                 f"{platform.machine()}, {os.cpu_count()} cores)", "",
             f"Command: `python tools/bench/bench_quality.py --runs {args.runs} --seeds {args.seeds} --tokens "
             f"{args.tokens} --keep-top {args.keep_top}`  ",
             f"Data (tools/bench/quality_corpus.py): {n_labels:,} labelled documents (pydoc prose `hq`, Debian "
             "copyright / changelog / README.Debian pieces `lq`), 20 % held out; peer: datatrove 0.10.1 "
             "`FastTextClassifierFilter`.", "",
             "| classifier (held-out split) | precision | recall | F1 |", "|---|---|---|---|"]
    for name, rep_ in (("fastText bigrams (DCLM recipe)", ft["model"]),
                       ("embedding head on a frozen local encoder (FineWeb-Edu recipe; encoder: the ablation's "
                        "random-variant model, seed 1, HF export)", emb["model"]),
                       ("scikit-learn TF-IDF + logistic regression (same split)", ft["baseline"])):
        lines.append(f"| {name} | {rep_['precision']:.3f} | {rep_['recall']:.3f} | {rep_['f1']:.3f} |")
    lines += ["", "| what | ours | datatrove | ratio |", "|---|---|---|---|",
              f"| scores equal / keep decisions equal ({sp['docs']:,} documents) | {sp['same_scores']:,} / "
              f"{'all' if sp['same_decisions'] else 'NOT all'} | | |",
              f"| filter documents per CPU-second (median of {args.runs}) | {sp['ours_docs_per_cpu_s']:,.0f} | "
              f"{sp['theirs_docs_per_cpu_s']:,.0f} | {sp['ratio']:.2f}x |", "",
              f"Prose share of the training source: {100 * r['share']['all']:.1f} %; of its top "
              f"{100 * args.keep_top:.0f} % by the classifier's score: {100 * r['share']['top']:.1f} %. "
              f"Tokens: random variant {abl['tokens_random']:,}, classifier variant {abl['tokens_classifier']:,}; "
              f"each run trains {args.tokens:,} (rounded down to whole steps). Ablation wall time "
              + (f"{abl['wall_s'] / 60:.1f} min (--jobs 2)." if abl["wall_s"] > 60 else
                 "not measured here (its runs were finished by an earlier run of the script; `train ablate` "
                 "skipped them)."), "", "```", abl["stdout"].strip(), "```", ""]
    del rep
    history.append_section(lines)


if __name__ == "__main__":
    sys.exit(main())
