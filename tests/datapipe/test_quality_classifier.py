"""Quality classifiers (datapipe.quality): byte-identical training, parity of the `classifier` filter with
datatrove's FastTextClassifierFilter, a build that filters by score (metadata, manifest histogram, report,
keep_top), bad input named by key and file, and an embedding head that learns a separable set."""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
from testutil import read_corpus, write_jsonl

from datapipe.config import (BuildConfig, DedupConfig, FilterSpec, MinhashSettings, NormalizeConfig, ShardsConfig,
                             SourceConfig, TokenizerConfig, ValidationConfig)
from datapipe.normalize import normalize_text
from datapipe.pipeline import Build
from datapipe.quality.fasttext_clf import score_texts
from datapipe.quality.train import TrainOptions, train_classifier
from storage.config import ConfigError
from storage.dataset import iter_documents
from storage.manifest import read_manifest

FRENCH = [{"id": f"fr{i}", "text": t} for i, t in enumerate((
    "Le chat dort sur la table de la cuisine pendant que les enfants jouent dans le jardin avec leurs amis.",
    "Nous avons visité le musée hier après-midi et nous avons beaucoup aimé les peintures de cette époque."))]
FT = {"dim": 16, "bucket": 20_000}  # a small model file (~1.5 MB): the recipe's defaults make ~800 MB


def _annotations(path: Path, good: list[str], bad: list[str]) -> str:
    """`datapipe annotate`-style records: good text 4, bad text 1, and one unparseable reply (null)."""
    recs = [{"id": f"g{i}", "text": t, "score": 4} for i, t in enumerate(good)]
    recs += [{"id": f"b{i}", "text": t, "score": 1} for i, t in enumerate(bad)]
    recs.insert(5, {"id": "null", "text": "a reply without a score", "score": None})
    return write_jsonl(path, recs)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quality")


@pytest.fixture(scope="module")
def annotations(root) -> str:
    good = [d["text"] for d in read_corpus("pydoc", 300)]
    bad = [d["text"] for d in read_corpus("fortunes", 300)]
    return _annotations(root / "ann.jsonl", good, bad)


@pytest.fixture(scope="module")
def ft_model(root, annotations) -> Path:
    out = root / "ft"
    train_classifier(TrainOptions("fasttext", [annotations], str(out), seed=7, baseline=True, **FT), echo=lambda s: None)
    return out


@pytest.fixture(scope="module")
def held_out() -> list[dict]:
    """Documents none of the models saw: pydoc sections (multi-line prose) and fortunes."""
    return read_corpus("pydoc", 200, start=300) + read_corpus("fortunes", 200, start=300)


def test_fasttext_training_is_byte_identical_and_evaluated(root, annotations, ft_model):
    again, other = root / "ft-again", root / "ft-seed8"
    train_classifier(TrainOptions("fasttext", [annotations], str(again), seed=7, baseline=True, **FT),
                     echo=lambda s: None)
    train_classifier(TrainOptions("fasttext", [annotations], str(other), seed=8, **FT), echo=lambda s: None)
    for name in ("model.bin", "model.json", "eval.json"):
        assert (ft_model / name).read_bytes() == (again / name).read_bytes(), name
    assert (ft_model / "model.bin").read_bytes() != (other / "model.bin").read_bytes()  # the seed matters
    ev = json.loads((ft_model / "eval.json").read_text())
    assert ev["skipped"] == {"no score": 1} and ev["examples"] == 600 and ev["held_out_examples"] == 60
    for name in ("model", "baseline"):
        m, c = ev[name], ev[name]["confusion"]
        assert sum(c.values()) == 60 and c["true_positive"] + c["false_negative"] == m["positives"]
        assert m["f1"] >= 0.8, (name, m)


@pytest.mark.parametrize("newline", [" ", ""])
def test_filter_equals_datatrove_fasttext_filter(root, ft_model, held_out, newline):
    """Same model, same documents: every score and every keep decision equal datatrove's filter's."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import FastTextClassifierFilter

    from datapipe.quality.qfilter import ClassifierFilter

    model = ft_model / "model.bin"
    # datatrove caches a model by its path's name: a name from the content keeps a stale copy out
    digest = hashlib.sha256(model.read_bytes()).hexdigest()[:16]
    named = root / f"parity-{digest}.bin"
    shutil.copyfile(model, named)
    assert sum("\n" in d["text"] for d in held_out) > 100  # the preprocessing matters on these

    def docs():
        return [Document(text=d["text"], id=str(i)) for i, d in enumerate(held_out)]

    theirs = FastTextClassifierFilter(str(named), keep_labels=("hq", 0.5), newline_replacement=newline)
    their_docs = docs()
    kept_theirs = {d.id for d in theirs.run(iter(their_docs))}
    ours = ClassifierFilter({"model": str(model), "threshold": 0.5, "newline_replacement": newline, "batch_size": 64},
                            "0_classifier")
    our_docs = docs()
    kept_ours = {d.id for d in ours.run(iter(our_docs))}
    their_scores = [d.metadata["__label__hq"] for d in their_docs]
    assert [d.metadata["quality_score"] for d in our_docs] == their_scores
    assert kept_ours == kept_theirs
    assert 100 < len(kept_ours) < 300  # both classes present: the decisions are not trivial
    assert score_texts(str(model), [d["text"] for d in held_out], newline_replacement=newline) == their_scores


@pytest.fixture(scope="module")
def encoder(root) -> str:
    """A tiny random-init BERT and a word-level tokenizer of the commonest words of some test text (no hub;
    built from sorted counts: the `tokenizers` trainers break ties differently run to run)."""
    from collections import Counter

    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    folder = root / "encoder"
    texts = [d["text"][:1000] for d in read_corpus("pydoc", 100) + read_corpus("fortunes", 300)]
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts = Counter(w for t in texts for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(t)))
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = specials + [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:1500]]
    tok.model = models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(folder)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def head(root, encoder) -> tuple[Path, dict]:
    """A regression head on a toy set: pydoc prose scored 4, fortunes scored 1 (separable)."""
    good = [d["text"][:400] for d in read_corpus("pydoc", 150, start=600)]
    bad = [d["text"][:400] for d in read_corpus("fortunes", 150, start=600)]
    data = _annotations(root / "toy.jsonl", good, bad)
    out = root / "head"
    ev = train_classifier(TrainOptions("embedding", [data], str(out), seed=3, encoder=encoder, max_length=64,
                                       holdout=0.2), echo=lambda s: None)
    return out, ev


def test_embedding_head_learns_a_separable_set_reproducibly(root, head, encoder):
    out, ev = head
    assert ev["held_out_examples"] == 60 and ev["model"]["f1"] >= 0.9, ev["model"]
    meta = json.loads((out / "head.json").read_text())
    assert meta["score_range"] == [1.0, 4.0] and meta["threshold"] == 3.0 and meta["cut"] == 2.5
    assert meta["encoder_sha256"] == hashlib.sha256((Path(encoder) / "model.safetensors").read_bytes()).hexdigest()
    again = root / "head-again"
    train_classifier(TrainOptions("embedding", [str(root / "toy.jsonl")], str(again), seed=3, encoder=encoder,
                                  max_length=64, holdout=0.2), echo=lambda s: None)
    for name in ("head.safetensors", "head.json", "eval.json"):
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def _source(root: Path, name: str, docs: list[dict], filters: list[FilterSpec]) -> SourceConfig:
    return SourceConfig(name, [write_jsonl(root / "in" / f"{name}.jsonl", docs)], filters=filters)


@pytest.fixture(scope="module")
def built(root, ft_model, head, held_out, small_tokenizer):
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(held_out)]
    model = str(ft_model / "model.bin")
    out = root / "out"
    cfg = BuildConfig(
        output=str(out),
        sources=[_source(root, "thr", docs, [FilterSpec("classifier", {"model": model, "threshold": 0.5})]),
                 _source(root, "top", docs, [FilterSpec("classifier", {"model": model, "keep_top": 0.3})]),
                 _source(root, "routed", docs[:60] + docs[-60:] + FRENCH,
                         [FilterSpec("classifier", {"models": {"en": str(head[0])}})])],
        tokenizer=TokenizerConfig(path=small_tokenizer), shards=ShardsConfig(block_tokens=8192, shard_blocks=4),
        dedup=DedupConfig(exact=False, minhash=MinhashSettings(enabled=False)),
        validation=ValidationConfig(fraction=0.0))
    Build(cfg).run(progress=False)
    return cfg, docs, read_manifest(str(out))


def _kept_ids(cfg, m, source: str) -> set[str]:
    return {doc_id.removeprefix(f"{source}/") for doc_id, _ in iter_documents(cfg.output, m.sources[source].shards)}


def _rejects(cfg, source: str) -> list[dict]:
    out = []
    for p in sorted(Path(cfg.output, "rejects", "0_classifier").glob("*.jsonl.gz")):
        with gzip.open(p, "rt") as f:
            out += [r for r in map(json.loads, f) if r["id"].startswith(f"{source}/")]
    return [{**r, "id": r["id"].removeprefix(f"{source}/")} for r in out]


def test_build_keeps_by_score_and_records_it(built, ft_model, capsys, tmp_path):
    cfg, docs, m = built
    texts = [normalize_text(d["text"], NormalizeConfig()) for d in docs]
    scores = score_texts(str(ft_model / "model.bin"), texts)
    expected = {d["id"] for d, s in zip(docs, scores) if s >= 0.5}
    assert _kept_ids(cfg, m, "thr") == expected and 100 < len(expected) < 300
    q = m.sources["thr"].quality["0_classifier"]
    assert q["thresholds"] == {"default": 0.5} and q["ranges"] == {"default": [0.0, 1.0]} and q["bins"] == 20
    assert sum(q["histograms"]["default"]) == len(docs) and q["kept"]["default"] == len(expected)
    assert q["histograms"]["default"] == [sum(min(int(s * 20), 19) == b for s in scores) for b in range(20)]
    assert not any(k.startswith("quality_") for k in m.sources["thr"].stats)  # moved into `quality`
    assert m.sources["thr"].stats["dropped_0_classifier:classifier_below_threshold"] == len(docs) - len(expected)
    # scores in the metadata: the rejects carry theirs; the kept ones' are recorded for the re-read
    by_id = dict(zip((d["id"] for d in docs), scores))
    rej = [r for r in _rejects(cfg, "thr") if r["id"] in by_id and r["id"] not in expected]
    assert len(rej) == len(docs) - len(expected)
    assert all(r["metadata"]["quality_score"] == by_id[r["id"]] < 0.5 for r in rej)
    assert all(r["metadata"]["filter_reason"] == "classifier_below_threshold" for r in rej)
    with gzip.open(Path(cfg.output, "_work", "langs", "00000.json.gz")) as f:
        labels = json.load(f)
    assert sorted(row[-1] for row in labels) == sorted(by_id[i] for i in expected)
    from datapipe.cli import main

    from click.testing import CliRunner

    res = CliRunner().invoke(main, ["report", cfg.output, "--charts", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (f"classifier 0_classifier of thr: model {ft_model / 'model.bin'}, threshold 0.5; {len(expected):,} of "
            f"{len(docs):,} scored documents kept") in res.output
    assert (tmp_path / "quality_thr.png").stat().st_size > 5000 and (tmp_path / "quality_routed.png").exists()


def test_keep_top_keeps_the_calibrated_share(built):
    cfg, docs, m = built
    q = m.sources["top"].quality["0_classifier"]
    n = sum(q["histograms"]["default"])
    assert n == len(docs) and q["calibration_documents"] == {"default": n} and q["keep_top"] == 0.3
    assert q["kept"]["default"] == m.sources["top"].documents == math.ceil(0.3 * n)
    scores = sorted((r["metadata"]["quality_score"] for r in _rejects(cfg, "top")), reverse=True)
    assert len(scores) == n - math.ceil(0.3 * n) and scores[0] < q["thresholds"]["default"]


def test_per_language_models_route_and_count_the_rest(built):
    cfg, docs, m = built
    q = m.sources["routed"].quality["0_classifier"]
    assert q["models"] == {"en": str(Path(cfg.output).parent / "head")} and q["ranges"] == {"en": [1.0, 4.0]}
    assert q["thresholds"] == {"en": 2.5}  # the head's own cut: int_score >= 3
    scored = sum(q["histograms"]["en"])
    assert scored + q["unscored"] == 122 and scored >= 100 and q["unscored"] >= 2
    kept = _kept_ids(cfg, m, "routed")
    assert {"fr0", "fr1"} <= kept  # no model for French: kept unscored
    prose = len({i for i in kept if i.startswith("d") and int(i[1:]) < 60})
    quotes = len({i for i in kept if i.startswith("d") and int(i[1:]) >= 60})
    assert prose >= 50 and quotes <= 20  # of 60 each: the head keeps the prose it learnt to keep


def _config(root: Path, params: dict) -> BuildConfig:
    src = write_jsonl(root / "in" / "bad.jsonl", [{"id": "a", "text": "one document"}])
    return BuildConfig(output=str(root / "bad-out"), sources=[SourceConfig("s", [src], filters=[
        FilterSpec("gopher_quality"), FilterSpec("classifier", params)])])


@pytest.mark.parametrize("params, message", [
    ({"model": "MISSING.bin"}, r"^key 'sources\.0\.filters\.1\.params\.model': model file '.*MISSING\.bin' not found"),
    ({"model": "FT", "label": "good"}, r"^key 'sources\.0\.filters\.1\.params\.label': 'good' is not a label of model "
                                       r".*model\.bin \(its labels: hq, lq\)$"),
    ({"model": "FT", "threshold": 1.5}, r"^key 'sources\.0\.filters\.1\.params\.threshold': 1\.5 is outside the score "
                                        r"range \[0, 1\] of model .*model\.bin$"),
    ({"model": "HEAD", "threshold": 4.5}, r"^key 'sources\.0\.filters\.1\.params\.threshold': 4\.5 is outside the "
                                          r"score range \[1, 4\] of model .*head$"),
    ({"model": "FT", "keep_top": 0}, r"^key 'sources\.0\.filters\.1\.params\.keep_top': must be a share in \(0, 1\]"),
    ({"model": "FT", "keep_top": 1.5}, r"^key 'sources\.0\.filters\.1\.params\.keep_top': must be a share in \(0, 1\]"),
    ({"model": "FT", "keep_top": 0.1, "threshold": 0.5}, r"^key 'sources\.0\.filters\.1\.params': give threshold or "
                                                         "keep_top, not both$"),
    ({"models": {"en": "FT", "fr": "MISSING.bin"}}, r"^key 'sources\.0\.filters\.1\.params\.models\.fr': model file"),
    ({"model": "FT", "treshold": 0.5}, r"^key 'sources\.0\.filters\.1\.params\.treshold': unknown parameter"),
])
def test_bad_classifier_config_is_one_line_naming_key_and_file(root, ft_model, head, params, message):
    paths = {"FT": str(ft_model / "model.bin"), "HEAD": str(head[0]), "MISSING.bin": str(root / "MISSING.bin")}
    fix = {k: paths.get(v, v) if isinstance(v, str) else {a: paths.get(b, b) for a, b in v.items()}
           if isinstance(v, dict) else v for k, v in params.items()}
    with pytest.raises(ConfigError, match=message) as e:
        Build(_config(root, fix))  # before any stage runs
    assert "\n" not in str(e.value)
    assert not Path(root / "bad-out" / "_work" / "logs").exists()


def test_head_with_a_changed_encoder_is_refused(root, head, encoder, tmp_path):
    moved = tmp_path / "head"
    shutil.copytree(head[0], moved)
    meta = json.loads((moved / "head.json").read_text())
    meta["encoder_sha256"] = "0" * 64
    (moved / "head.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"^key 'sources\.0\.filters\.1\.params\.model': head '.*head': its encoder "
                                          r"'.*encoder' changed since training"):
        Build(_config(root, {"model": str(moved)}))


def test_classifier_allowed_in_every_kind(root, ft_model):
    from datapipe.kinds.config import check_chain

    for kind in ("web", "code", "math"):
        check_chain([FilterSpec("classifier", {"model": str(ft_model / "model.bin")})], kind, "filters")


def test_build_cli_error_is_one_line_with_config_file(root, ft_model, tmp_path):
    from click.testing import CliRunner

    from datapipe.cli import main

    src = write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "text": "one document"}])
    model = ft_model / "model.bin"
    cfg = tmp_path / "build.yaml"
    cfg.write_text(json.dumps({"output": str(tmp_path / "o"), "sources": [{"name": "s", "paths": [src], "filters": [
        {"type": "classifier", "params": {"model": str(model), "label": "good"}}]}]}))
    res = CliRunner().invoke(main, ["build", str(cfg)])
    assert res.exit_code != 0
    assert res.output.strip() == (f"error: {cfg}: key 'sources.0.filters.0.params.label': 'good' is not a label of "
                                  f"model {model} (its labels: hq, lq)"), res.output


def test_classifier_cli_trains_scores_and_names_bad_lines(tmp_path):
    from click.testing import CliRunner

    from datapipe.cli import main

    data = _annotations(tmp_path / "a.jsonl", [d["text"][:500] for d in read_corpus("pydoc", 40)],
                        [d["text"] for d in read_corpus("fortunes", 40)])
    out = tmp_path / "m"
    res = CliRunner().invoke(main, ["classifier", "train", "--kind", "fasttext", "--data", data, "--output", str(out),
                                    "--dim", "16", "--bucket", "20000", "--seed", "1", "--baseline"])
    assert res.exit_code == 0, res.output
    assert "80 examples (40 positive)" in res.output and "skipped: no score 1" in res.output
    assert "fasttext: precision" in res.output and "baseline (TF-IDF + logistic regression): precision" in res.output
    res = CliRunner().invoke(main, ["classifier", "score", str(out / "model.bin"), data, "-o", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    scores = [json.loads(x) for x in (tmp_path / "s").read_text().splitlines()]
    assert len(scores) == 81 and scores[0]["id"] == "g0" and all(0 <= s["score"] <= 1 for s in scores)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine", "score": 2}, {"text": "no", "score": "high"}])
    res = CliRunner().invoke(main, ["classifier", "train", "--kind", "fasttext", "--data", bad, "--output", str(out)])
    assert res.exit_code != 0
    assert res.output.strip() == f"error: {bad} line 2: 'score' must be a finite number or null, got 'high'"
