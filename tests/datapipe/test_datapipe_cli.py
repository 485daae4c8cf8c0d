"""The `datapipe` command: demo build, tokenizer training, mix rewrite and validation, report, Slurm scripts
(the engines themselves: test_datapipe_engines.py)."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from testutil import read_corpus, write_jsonl

from datapipe.cli import main
from datapipe.config import BuildConfig, MixConfig, PhaseSpec, SourceConfig, TokenizerConfig
from datapipe.pipeline import Build
from storage.config import ConfigError
from storage.manifest import read_manifest


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """`datapipe build` with no config: the embedded stdlib corpus (docstrings, help topics and the standard
    library's own source files as a code source), a mix, a trained tokenizer."""
    out = tmp_path_factory.mktemp("demo") / "ds"
    res = CliRunner().invoke(main, ["build", "--set", f"output={out}", "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "total" in res.output and "mix phase stable" in res.output
    return out


def test_demo_build_has_three_sources_a_mix_and_a_trained_tokenizer(demo):
    from datapipe.demo import stdlib_files

    m = read_manifest(str(demo))
    assert set(m.sources) == {"stdlib", "topics", "code"} and all(s.tokens > 0 for s in m.sources.values())
    assert [p.name for p in m.mix] == ["stable", "decay"]
    assert m.mix[1].weights["code"] > m.mix[0].weights["code"]
    # the code source is the standard library's own files, judged by The Stack's rules, not the prose rules
    # (which kept 0 of them): at least 90% pass the filters (dedup then drops the codec tables' near-copies)
    code = m.sources["code"]
    assert code.content == "code" and code.stats["read"] == len(stdlib_files())
    assert code.stats["kept_code_language:python"] >= 0.9 * code.stats["read"], code.stats
    assert sum(p.tokens for p in m.mix) == pytest.approx(m.total_tokens, abs=1)
    assert m.tokenizer.vocab_size == 4096 and (demo / "tokenizer.json").exists()


def test_mix_rewrites_schedule_only(demo, tmp_path):
    before = read_manifest(str(demo))
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": str(demo), "mix": {"total_tokens": 1000, "phases": [
        {"name": "a", "weights": {"stdlib": 1.0}, "tokens": 600},
        {"name": "b", "weights": {"stdlib": 1.0, "topics": 3.0}, "tokens": 400}]}}))
    res = CliRunner().invoke(main, ["mix", str(cfg)])
    assert res.exit_code == 0, res.output
    after = read_manifest(str(demo))
    assert [(p.name, p.tokens) for p in after.mix] == [("a", 600), ("b", 400)]
    assert after.sources == before.sources and after.build_stats == before.build_stats
    card = (demo / "README.md").read_text()  # the dataset card's mix table follows (sources: stdlib, topics, code)
    assert "| a | 600 | 1 |  |  |\n| b | 400 | 1 | 3 |  |\n" in card and "| stable |" not in card


@pytest.mark.parametrize("phases, total, message", [
    ([{"name": "a", "weights": {"nope": 1.0}, "tokens": 10}], None, "unknown source 'nope'"),
    ([{"name": "a", "weights": {"stdlib": 0.0}, "tokens": 10}], None, "must be > 0"),
    ([{"name": "a", "weights": {"stdlib": 1.0}, "tokens": 10}], 11, "add up to 10"),
    ([{"name": "a", "weights": {"stdlib": 1.0}, "fraction": 0.5}], None, "add up to 0.5"),
])
def test_mix_validation_errors(demo, tmp_path, phases, total, message):
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": str(demo), "mix": {"total_tokens": total, "phases": phases}}))
    res = CliRunner().invoke(main, ["mix", str(cfg)])
    assert res.exit_code != 0 and message in res.output, res.output


def test_report_prints_summary_and_writes_charts(demo, tmp_path):
    res = CliRunner().invoke(main, ["report", str(demo), "--charts", str(tmp_path / "charts")])
    assert res.exit_code == 0, res.output
    assert "stdlib" in res.output and "tokens" in res.output
    for name in ("drops_per_filter.png", "tokens_per_source.png"):
        assert (tmp_path / "charts" / name).read_bytes()[:4] == b"\x89PNG"


def test_tokenizer_train_cli(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", read_corpus("pydoc", 80))
    out = tmp_path / "tok.json"
    res = CliRunner().invoke(main, ["tokenizer", "train", "--vocab-size", "600", "-o", str(out), src])
    assert res.exit_code == 0, res.output
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out))
    assert tok.get_vocab_size() == 600 and tok.token_to_id("<|endoftext|>") == 0
    text = "def f(x):\n    return x ** 2  # ünïcode"
    assert tok.decode(tok.encode(text).ids) == text


def test_unknown_config_key_names_key_and_file(tmp_path):
    cfg = tmp_path / "b.yaml"
    cfg.write_text("output: x\nshardz: {}\n")
    res = CliRunner().invoke(main, ["build", str(cfg)])
    assert res.exit_code != 0 and "shardz" in res.output and str(cfg) in res.output


def test_filter_params_and_model_paths_are_checked(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "text": "hello world"}])
    bad = BuildConfig(output=str(tmp_path / "o"), sources=[SourceConfig("s", [src], filters=[
        __import__("datapipe.config", fromlist=["FilterSpec"]).FilterSpec("gopher_quality", {"min_words": 3})])])
    with pytest.raises(ConfigError, match="unknown parameter 'min_words'.*min_doc_words"):
        Build(bad)
    hub = BuildConfig(output=str(tmp_path / "o"), sources=[SourceConfig("s", [src], filters=[
        __import__("datapipe.config", fromlist=["FilterSpec"]).FilterSpec("language", {"model": "facebook/lid"})])])
    with pytest.raises(ConfigError, match="not a local file"):
        Build(hub)


def test_mix_config_fractions_resolve():
    mc = MixConfig(phases=[PhaseSpec("s", {"a": 1.0}, fraction=0.75), PhaseSpec("d", {"a": 1.0}, fraction=0.25)])
    assert [p.tokens for p in mc.resolve({"a": 1000})] == [750, 250]


def test_slurm_dry_run_writes_chained_sbatch_scripts(tmp_path, small_tokenizer):
    srcs = [write_jsonl(tmp_path / f"in{i}.jsonl", read_corpus("fortunes", 30, start=30 * i)) for i in range(3)]
    cfg = BuildConfig(output=str(tmp_path / "out"), sources=[SourceConfig("web", srcs, filters=[])],
                      tokenizer=TokenizerConfig(path=small_tokenizer))
    cfg.executor.kind = "slurm"
    cfg.executor.slurm.partition = "cpu-small"
    scripts = Build(cfg).submit_slurm(dry_run=True)
    cc = ["cc-edges", *(f"cc-{k}" for k in range(1, 9)), "cc-finish", "clusters"]  # 4 rounds: 8 steps
    names = ["scan", "exact", "buckets", "verify", *cc, "tokenizer", "tokenize", "validation", "manifest"]
    texts = [Path(s).read_text() + Path(s + ".cmd").read_text() for s in scripts]
    jobs = [t for t in texts if "launch_pickled_pipeline" in t]
    assert len(jobs) == len(texts)  # one job per stage, no extra job merging its stats
    assert [t.split("--job-name=datapipe-")[1].split()[0] for t in jobs] == names
    first = jobs[0]
    assert first.startswith("#!/bin/bash") and "#SBATCH --partition=cpu-small" in first
    assert f"{sys.executable} -m datatrove.tools.launch_pickled_pipeline" in first  # the building python
    assert "#SBATCH --array=0-2" in first and "--dependency" not in first
    assert "#SBATCH --array=0-7" in jobs[1]  # one exact task per hash partition
    assert "#SBATCH --array=0-19" in jobs[2] and "#SBATCH --array=0-19" in jobs[3]  # a bucket, verify task per band
    assert all("#SBATCH --array=0-3" in jobs[names.index(n)] for n in cc if n != "cc-finish")  # cluster_parts
    assert "#SBATCH --array=0-0" in jobs[names.index("cc-finish")]
    ids = {t: str(1001 + texts.index(t)) for t in jobs}  # dry-run job ids are 1001, 1002, ... in order
    for prev, t in itertools.pairwise(jobs):
        assert f"--dependency=afterok:{ids[prev]}" in t.splitlines()[-1]
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_hub_tokenizer_name_offline_gives_clear_error(monkeypatch):
    import datapipe.tokenize as tk

    monkeypatch.setattr(tk, "_hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(FileNotFoundError, match="not reachable.*tokenizer.json"):
        tk.load_tokenizer("openai-community/gpt2")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tk.load_tokenizer("missing/dir/tokenizer.json")
