"""The fast English word tokenizer and filter chain agree with datatrove's spaCy-based ones."""
from __future__ import annotations

import pickle

from testutil import read_corpus, require
from datatrove.data import Document
from datatrove.pipeline.filters import GopherRepetitionFilter

from datapipe.config import fineweb_filters
from datapipe.filters import _CLASSES, FastGopherRepetitionFilter, build_filter
from datapipe.wordtok import FastWordTokenizer, tokenize_words


def _sample() -> list[str]:
    docs = read_corpus("fortunes", 120) + read_corpus("pydoc", 60) + read_corpus("shakespeare", 20)
    docs += read_corpus("licenses") + read_corpus("fortunes", 60, start=9000) + read_corpus("pydoc", 30, start=3000)
    return [d["text"] for d in docs]


def _keep(filters, text: str) -> bool:
    doc = Document(text=text, id="x")
    for f in filters:
        r = f.filter(doc)
        if not (r[0] if isinstance(r, tuple) else r):
            return False
    return True


def test_tokens_match_spacy():
    require("spacy")
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    spacy_tok = load_word_tokenizer("en")
    texts = _sample()
    same = sum(spacy_tok.word_tokenize(t) == tokenize_words(t) for t in texts)
    assert same >= 0.98 * len(texts), f"identical token lists for {same}/{len(texts)} documents"


def test_sentence_counts_match_spacy():
    require("spacy")
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    spacy_tok, fast = load_word_tokenizer("en"), FastWordTokenizer()
    lines = [ln.strip() for t in _sample()[:150] for ln in t.splitlines() if ln.strip()][:1500]
    same = sum(len(spacy_tok.span_tokenize(ln)) == len(fast.span_tokenize(ln)) for ln in lines)
    assert same >= 0.99 * len(lines), f"{same}/{len(lines)}"


def test_keep_decisions_agree_with_spacy_chain(tmp_path):
    require("spacy")
    fast = [build_filter(s, FastWordTokenizer()) for s in fineweb_filters()]
    slow = [_CLASSES[s.type](language="en", **s.params) for s in fineweb_filters()]
    assert isinstance(fast[0], FastGopherRepetitionFilter)
    texts = _sample()
    decisions = [(_keep(fast, t), _keep(slow, t)) for t in texts]
    agree = sum(a == b for a, b in decisions)
    assert agree >= 0.99 * len(texts), f"{agree}/{len(texts)}"
    assert 0 < sum(b for _, b in decisions) < len(texts)  # the sample has both kept and dropped documents


def test_fast_repetition_filter_matches_datatrove_on_long_documents():
    tok = FastWordTokenizer()
    ours, ref = FastGopherRepetitionFilter(language=tok), GopherRepetitionFilter(language=tok)
    texts = [d["text"] for d in read_corpus("shakespeare", 40) + read_corpus("pydoc", 80) + read_corpus("licenses")]
    long = [t for t in texts if len(tokenize_words(t)) >= 400]
    assert len(long) >= 40
    for t in long:
        assert ours.filter(Document(text=t, id="x")) == ref.filter(Document(text=t, id="x"))
    # a highly repetitive long document is dropped for the same reason
    rep = " ".join(["the same sentence comes back again and again."] * 200)
    assert ours.filter(Document(text=rep, id="r")) == ref.filter(Document(text=rep, id="r")) != True  # noqa: E712


def test_contractions_urls_and_pickling():
    assert tokenize_words("Don't stop-me now... U.S.A. (see http://x.org).") == \
        ["Do", "n't", "stop", "-", "me", "now", "...", "U.S.A.", "(", "see", "http://x.org", ")", "."]
    tok = pickle.loads(pickle.dumps(FastWordTokenizer()))
    assert tok.word_tokenize("Hello, world!") == ["Hello", ",", "world", "!"]
    assert len(tok.span_tokenize("One. Two! Three")) == 3



def test_fast_quality_and_c4_filters_equal_datatrove():
    """Same decision and the same rewritten text (C4 drops lines) as datatrove's classes, same tokenizer."""
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter

    from datapipe.fastfilters import FastC4QualityFilter, FastGopherQualityFilter

    tok = FastWordTokenizer()
    texts = _sample() + [d["text"] for d in read_corpus("fortunes", 400, start=2000)]
    pairs = [(FastGopherQualityFilter(language=tok), GopherQualityFilter(language=tok)),
             (FastC4QualityFilter(language=tok), C4QualityFilter(language=tok)),
             (FastC4QualityFilter(language=tok, filter_no_terminal_punct=False, min_num_sentences=2),
              C4QualityFilter(language=tok, filter_no_terminal_punct=False, min_num_sentences=2))]
    for fast, ref in pairs:
        results, rewritten = set(), 0
        for t in texts:
            a, b = Document(text=t, id="x"), Document(text=t, id="x")
            res = fast.filter(a)
            assert res == ref.filter(b), (type(ref).__name__, t[:80])
            assert a.text == b.text
            results.add(res is True)
            rewritten += a.text != t
        assert results == {True, False}  # the sample has kept and dropped documents for every filter
        assert rewritten or isinstance(ref, GopherQualityFilter)  # C4 rewrote some texts
