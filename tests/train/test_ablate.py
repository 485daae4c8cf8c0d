"""`train ablate`: one real ablation (2 variants × 2 seeds of a tiny model on real text, one held-out validation
set built here, one task), shared by the tests of this file; then reruns, refusals and the Slurm script on its
outputs (no training), and the statistics and verdict wording on numbers given here."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from testutil import REPO, metric_records, read_corpus, write_jsonl, write_random_dataset

from storage import config as cfgmod
from storage.config import ConfigError
from storage.manifest import read_manifest
from train import ablate_report as rep
from train.ablate import Ablation
from train.ablate_config import AblationConfig
from train.cli import main as train_cli

SEEDS, STEPS, BATCH, SEQ = [1, 2], 12, 8, 128
TOKENS = STEPS * BATCH * SEQ
LABELS = ["fortunes.s1", "fortunes.s2", "pydoc.s1", "pydoc.s2"]


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    """The baseline trains on fortunes (unrelated text), the variant on pydoc; both are scored on held-out
    pydoc documents (a validation set built from other pydoc pages) and on 4 piqa items. Relative paths:
    the command runs in the folder (as a user's would). Returns (folder, stdout)."""
    root = tmp_path_factory.mktemp("ablate")
    docs = read_corpus("pydoc", 500)
    write_jsonl(root / "in" / "pydoc.jsonl", docs[:100])
    write_jsonl(root / "in" / "fortunes.jsonl", read_corpus("fortunes", 3000))
    write_jsonl(root / "in" / "heldout.jsonl", docs[400:500])
    common = {"langid": {"enabled": False}, "dedup": {"exact": False, "minhash": {"enabled": False}},
              "shards": {"block_tokens": 16384, "shard_blocks": 8}}
    files = {
        # no tokenizer.path: the baseline's build trains one, every other build uses it
        "build": {**common, "tokenizer": {"vocab_size": 1024}, "validation": {"fraction": 0.01},
                  "sources": [{"name": "text", "paths": ["in/fortunes.jsonl"], "filters": []}]},
        "val": {**common, "validation": {"fraction": 0.5},
                "sources": [{"name": "pydoc", "paths": ["in/heldout.jsonl"], "filters": []}]},
        "train": {"model": {"preset": "tiny", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 176,
                            "num_heads": 2, "num_kv_heads": 1},
                  "data": {"seq_len": SEQ}, "parallel": {"micro_batch_size": BATCH, "global_batch_size": BATCH},
                  "optim": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 2},
                  "monitor": {"log_every": 4, "tensorboard": False},
                  "checkpoint": {"full_every": 0, "incremental_every": 0}},
        "ablation": {"output": "out", "build": "build.yaml", "train": "train.yaml", "tokens": TOKENS + 100,
                     "seeds": SEEDS, "variants": {"fortunes": {}, "pydoc": {"sources.0.paths": ["in/pydoc.jsonl"]}},
                     "validation": {"pydoc": "val.yaml"}, "validation_tokens": 4096, "tasks": ["piqa"], "limit": 4, "nproc": 1},
    }
    for name, data in files.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "train.cli", "ablate", "ablation.yaml"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return root, r.stdout


def _ablate(root: Path, *args: str):
    """`train ablate ablation.yaml ARGS` in this process, in the ablation's folder."""
    cwd = os.getcwd()
    os.chdir(root)
    try:
        return CliRunner().invoke(train_cli, ["ablate", "ablation.yaml", *args])
    finally:
        os.chdir(cwd)


def _error(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.slow
def test_every_run_trains_equal_tokens_on_one_tokenizer_and_is_scored_everywhere(ablation):
    root, _ = ablation
    out = root / "out"
    shas = {read_manifest(str(out / d)).tokenizer.sha256 for d in ("data/fortunes", "data/pydoc", "validation/pydoc")}
    assert len(shas) == 1  # the variant and the validation set were built on the baseline's tokenizer
    for label in LABELS:
        variant, seed = label.split(".s")
        recs = metric_records(out / "runs" / variant / f"seed{seed}")
        assert recs[-1]["step"] == STEPS and recs[-1]["consumed_tokens"] == TOKENS, label  # tokens rounded down
        res = json.loads((out / "results" / f"{label}.json").read_text())
        assert (res["variant"], res["seed"], res["tokens"]) == (variant, int(seed), TOKENS)
        assert {"val/pydoc/loss", "val/pydoc/bpb", "eval/piqa/acc_norm"} <= set(res["metrics"]), label
        assert 0 < res["metrics"]["val/pydoc/bpb"] < 20
    # seeds differ (model and data order): no two runs of a variant give the same score
    vals = [json.loads((out / "results" / f"{lab}.json").read_text())["metrics"]["val/pydoc/loss"] for lab in LABELS]
    assert len(set(vals)) == 4


@pytest.mark.slow
def test_the_planted_difference_gets_the_right_verdict_table_and_plots(ablation):
    root, stdout = ablation
    out = root / "out"
    report = json.loads((out / "report.json").read_text())
    assert report["baseline"] == "fortunes" and report["missing"] == []
    bpb = report["metrics"]["val/pydoc/bpb"]
    assert bpb["lower_is_better"] and set(bpb["variants"]["pydoc"]["values"]) == {"1", "2"}
    # trained on pydoc, scored on held-out pydoc: lower bits per byte than the model trained on fortunes
    assert bpb["variants"]["pydoc"]["mean"] < bpb["variants"]["fortunes"]["mean"]
    assert bpb["variants"]["pydoc"]["z"] >= 1 and bpb["variants"]["pydoc"]["verdict"].startswith("better by ")
    line = next(ln for ln in stdout.splitlines() if ln.startswith("pydoc vs fortunes on val/pydoc/bpb: better by"))
    assert line in (out / "report.md").read_text() and "| `val/pydoc/bpb` (lower is better) |" in stdout
    assert report["metrics"]["eval/piqa/acc_norm"]["lower_is_better"] is False
    for metric in report["metrics"]:
        png = out / "plots" / (metric.replace("/", "_") + ".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", metric


@pytest.mark.slow
def test_a_rerun_skips_everything_done_and_dry_run_lists_what_is_left(ablation):
    root, _ = ablation
    out = root / "out"

    def snapshot():
        return {str(p): p.stat().st_mtime_ns for sub in ("logs", "runs", "eval", "data", "validation")
                for p in (out / sub).rglob("*") if p.is_file()}

    before = snapshot()
    r = _ablate(root)
    assert r.exit_code == 0, r.output
    assert "0 of 4 runs to train" in r.output and "0 evaluations to make" in r.output
    assert snapshot() == before  # no build, launch or evaluation ran: no log, checkpoint or result changed
    assert "pydoc vs fortunes on val/pydoc/bpb: better by" in r.output  # the report is made again

    done = next((out / "eval" / "pydoc").glob("*/pydoc.s2.json"))
    aside = done.with_name("kept-aside")
    done.rename(aside)
    try:
        r = _ablate(root, "--dry-run")
        assert r.exit_code == 0, r.output
        assert "0 of 4 runs to train" in r.output and "1 evaluations to make" in r.output
        assert "run pydoc.s2: trained; to evaluate on pydoc" in r.output
        r = _ablate(root, "--report")  # the report of what there is: the run without results is named
        assert r.exit_code == 0, r.output
        assert json.loads((out / "report.json").read_text())["missing"] == ["pydoc.s2"]
    finally:
        aside.rename(done)
    assert snapshot() == before


@pytest.mark.slow
def test_a_slurm_array_task_of_a_finished_run_only_merges_it(ablation):
    root, _ = ablation
    out = root / "out"
    logs = {p.name: p.stat().st_mtime_ns for p in (out / "logs").iterdir()}
    r = _ablate(root, "--task", "3")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "results" / "pydoc.s2.json").read_text())["label"] == "pydoc.s2"
    assert {p.name: p.stat().st_mtime_ns for p in (out / "logs").iterdir()} == logs  # no launch, no eval
    assert "there are 4 runs" in _error(_ablate(root, "--task", "4"))


@pytest.mark.slow
def test_slurm_writes_an_array_of_the_runs_left_and_a_report_job(ablation):
    root, _ = ablation
    out = root / "out"
    r = _ablate(root, "--slurm", "--dry-run", "--set", "seeds=[1,2,3]", "--set", "slurm.max_parallel=2",
                "--set", 'train_overrides={"launch.slurm.partition": "gpu", "launch.slurm.gpus_per_node": 2}')
    assert r.exit_code == 0, r.output
    script = (out / "slurm" / "ablate.sbatch").read_text()
    # runs in variant-major order: fortunes.s1..s3 = 0..2, pydoc.s1..s3 = 3..5; only the new seed's are left
    assert "#SBATCH --array=2,5%2\n" in script and "#SBATCH --nodes=1\n" in script
    assert "#SBATCH --partition=gpu\n" in script and "#SBATCH --gpus-per-node=2\n" in script
    assert f'-m train.cli ablate {(out / "ablation.yaml").resolve()} --task "$SLURM_ARRAY_TASK_ID"' in script
    assert yaml.safe_load((out / "ablation.yaml").read_text())["seeds"] == [1, 2, 3]
    report = (out / "slurm" / "report.sbatch").read_text()
    assert "--report" in report and "#SBATCH --partition=gpu" in report
    assert not (out / "runs" / "fortunes" / "seed3").exists()  # written, not run


@pytest.mark.slow
def test_refusals_name_the_key_the_variant_or_the_set(ablation, tmp_path):
    root, _ = ablation
    out = root / "out"
    assert "key 'variantz': unknown key" in _error(_ablate(root, "--set", "variantz={}"))
    assert "key 'baseline'" in _error(_ablate(root, "--set", "baseline=edu"))
    err = _error(_ablate(root, "--set", 'train_overrides={"parallel.tpp": 2}'))
    assert "key 'train'" in err and "parallel.tpp" in err
    assert "key 'train_overrides.seed'" in _error(_ablate(root, "--set", 'train_overrides={"seed": 3}'))
    # more tokens than the smaller variant (pydoc) holds: refused naming it, before anything runs
    seqs = {v: (read_manifest(str(out / "data" / v)).sources["text"].tokens - 1) // SEQ for v in ("fortunes", "pydoc")}
    assert seqs["pydoc"] < seqs["fortunes"]
    err = _error(_ablate(root, "--dry-run", "--set", f"tokens={(seqs['pydoc'] // BATCH + 1) * BATCH * SEQ}"))
    assert "variant 'pydoc': source 'text' holds" in err and "repeat data" in err
    # a validation set on another tokenizer
    write_random_dataset(str(tmp_path / "other"), {"x": 5}, vocab_size=1024)
    err = _error(_ablate(root, "--dry-run", "--set", f"validation.other={tmp_path / 'other'}"))
    assert "validation 'other'" in err and "share one tokenizer" in err
    # a variant whose override the build config does not know: datapipe's line, naming the variant
    err = _error(_ablate(root, "--set", 'variants.bad={"sources.0.filterz": []}'))
    assert "datapipe build of variant 'bad' failed" in err and "filterz" in err


def test_config_checks(tmp_path):
    (tmp_path / "b.yaml").write_text("{}")
    base = {"build": str(tmp_path / "b.yaml"), "train": str(tmp_path / "b.yaml"), "tokens": 1000,
            "variants": {"a": {}, "b": {}}, "validation": {"v": str(tmp_path / "b.yaml")}}
    assert cfgmod.from_dict(AblationConfig, base).baseline_name == "a"
    bad = [({"variants": {"a": {}}}, "key 'variants'"), ({"variants": {"a/b": {}, "c": {}}}, "key 'variants.a/b'"),
           ({"variants": {"a": {"output": "x"}, "b": {}}}, "key 'variants.a.output'"),
           ({"seeds": [1, 1]}, "key 'seeds'"), ({"validation": {"v": "nowhere"}}, "key 'validation.v'"),
           ({"validation": {}}, "key 'validation'"), ({"train": "nowhere.yaml"}, "key 'train'"),
           ({"tokens": 0}, "key 'tokens'"), ({"slurm": {"max_parallel": 0}}, "key 'slurm.max_parallel'")]
    for change, key in bad:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            cfgmod.from_dict(AblationConfig, {**base, **change})
    # the train config's defaults: batches of 8 × 256 tokens; tasks alone are scored on the baseline's dataset
    ab = Ablation(cfgmod.from_dict(AblationConfig, {**base, "tokens": 5000, "validation": {}, "tasks": ["piqa"]}))
    assert (ab.steps, ab.run_tokens, ab.runs[-1].label) == (2, 4096, "b.s3")
    assert [(g.name, g.dataset, g.validation_tokens, g.tasks) for g in ab.groups()] == [
        ("tasks", os.path.join("runs", "ablation", "data", "a"), 0, ["piqa"])]
    with pytest.raises(ConfigError, match="key 'tokens': 1,000 is less than one step"):
        Ablation(cfgmod.from_dict(AblationConfig, base))


def test_statistics_and_verdict_wording():
    s = rep.Stats({1: 1.0, 2: 2.0, 3: 3.0})
    assert (s.n, s.mean, s.se) == (3, 2.0, pytest.approx(1 / math.sqrt(3)))
    base = rep.Stats({1: 2.0, 2: 2.2, 3: 2.4})  # mean 2.2, se 0.11547
    low = rep.Stats({1: 1.4, 2: 1.6, 3: 1.8})  # mean 1.6: 0.6 / sqrt(2 × 0.11547²) = 3.67 standard errors
    z, verdict = rep.compare(low, base, lower_better=True)
    assert z == pytest.approx(0.6 / math.sqrt(2 * 0.2 ** 2 / 3)) and verdict == "better by 3.7 standard errors"
    z, verdict = rep.compare(low, base, lower_better=False)  # an accuracy: lower is worse
    assert z < 0 and verdict == "worse by 3.7 standard errors"
    assert rep.compare(rep.Stats({1: 2.1, 2: 2.3, 3: 2.5}), base, True)[1] == "no difference within 1 standard error"
    assert rep.compare(rep.Stats({1: 1.0}), base, True) == (None, "no verdict: a standard error needs at least 2 "
                                                               "seeds on each side")
    assert rep.lower_is_better("val/pydoc/bpb") and rep.lower_is_better("eval/codex_humaneval/bpb")
    assert not rep.lower_is_better("eval/piqa/acc_norm") and not rep.lower_is_better("eval/humaneval/pass@1")
    keys = {"val/p/loss", "val/p/ppl", "val/p/bpb", "eval/piqa/acc", "eval/humaneval/executions/error"}
    assert rep.default_metrics(keys) == ["val/p/bpb", "val/p/loss", "eval/piqa/acc"]

    results = [{"variant": v, "seed": s, "metrics": {"eval/t/acc": x}}
               for v, xs in (("a", (0.50, 0.52, 0.51)), ("b", (0.60, 0.61, 0.62))) for s, x in zip((1, 2, 3), xs)]
    r = rep.build_report(results, ["a", "b"], "a", [], ["a.s1", "a.s2", "a.s3", "b.s1", "b.s2", "b.s3"])
    assert [(row.variant, row.verdict) for row in r.rows] == [("a", ""), ("b", "better by 12.2 standard errors")]
    assert r.verdict_lines() == ["b vs a on eval/t/acc: better by 12.2 standard errors (0.61 ± 0.005774 vs "
                                 "0.51 ± 0.005774, 3 and 3 seeds)"]
    with pytest.raises(ConfigError, match=r"key 'metrics\.0': no result has 'val/x/bpb'"):
        rep.build_report(results, ["a", "b"], "a", ["val/x/bpb"], [])
