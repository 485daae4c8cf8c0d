"""datatrove's Gopher quality and C4 filters with the same rules and results, less Python work per word.

- `FastGopherQualityFilter`: whether a word is all punctuation and whether it has a letter are looked up
  in a per-process memo (words repeat: most of a document's words were seen before) instead of a
  generator over the word's characters, twice per word; the mean word length is sum / count, as
  `np.mean` computes it for integers; each distinct word is classed once, weighted by its count.
- `FastC4QualityFilter`: the per-line sentence count (a sentence split of every kept line) stops once the
  document has `min_num_sentences`, since the count is only compared with that minimum. A line in a
  script written without spaces (Chinese, Japanese, Thai) counts its words (punctuation aside) from the
  word split, not from spaces, where datatrove would see one word per line and drop it.
Both are used with the fast word tokenizer; tests/datapipe/test_datapipe_wordtok.py compares their
decisions and rewritten texts with datatrove's classes on the corpora.
"""
from __future__ import annotations

from collections import Counter
from itertools import compress
from operator import mul

from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter
from datatrove.pipeline.filters.c4_filters import CITATION_REGEX, ELLIPSIS, END_PUNCTUATION, POLICY_SUBSTRINGS
from datatrove.utils.text import PUNCTUATION_SET, split_into_sentences, split_into_words

from datapipe.segment import NO_SPACE_RE

_MEMO_MAX = 500_000  # words: ~50 MB at most
_SEEN: set[str] = set()  # words classed so far, and those of them with a non-punctuation character / a letter
_NON_SYMBOL: set[str] = set()
_ALPHA: set[str] = set()


def _class_new(words) -> None:
    new = words - _SEEN
    if not new:
        return
    if len(_SEEN) + len(new) > _MEMO_MAX:
        _SEEN.clear(), _NON_SYMBOL.clear(), _ALPHA.clear()
    for w in new:
        if any(ch not in PUNCTUATION_SET for ch in w):
            _NON_SYMBOL.add(w)
        if any(ch.isalpha() for ch in w):
            _ALPHA.add(w)
    _SEEN.update(new)


class FastGopherQualityFilter(GopherQualityFilter):
    def filter(self, doc):
        text = doc.text
        words = split_into_words(text, self.language)
        n_words = len(words)
        counts = Counter(words)  # classes per distinct word, weighted by its count, in C loops
        _class_new(counts.keys())
        keys, per_word = list(counts), list(counts.values())
        non_symbol = list(map(_NON_SYMBOL.__contains__, keys))
        n_non_symbol = sum(compress(per_word, non_symbol))
        len_non_symbol = sum(map(mul, compress(per_word, non_symbol), map(len, compress(keys, non_symbol))))
        n_alpha = sum(compress(per_word, map(_ALPHA.__contains__, keys)))
        if self.min_doc_words and n_non_symbol < self.min_doc_words:
            return False, "gopher_short_doc"
        if self.max_doc_words and n_non_symbol > self.max_doc_words:
            return False, "gopher_long_doc"
        avg = len_non_symbol / n_non_symbol if n_non_symbol else float("nan")
        if self.min_avg_word_length and avg < self.min_avg_word_length:
            return False, "gopher_below_avg_threshold"
        if self.max_avg_word_length and avg > self.max_avg_word_length:
            return False, "gopher_above_avg_threshold"
        if self.max_symbol_word_ratio and text.count("#") / n_words > self.max_symbol_word_ratio:
            return False, "gopher_too_many_hashes"
        if self.max_symbol_word_ratio and (text.count("...") + text.count("…")) / n_words > self.max_symbol_word_ratio:
            return False, "gopher_too_many_ellipsis"
        lines = text.splitlines()
        if (self.max_bullet_lines_ratio and sum(s.lstrip().startswith(("•", "-")) for s in lines) / len(lines)
                > self.max_bullet_lines_ratio):
            return False, "gopher_too_many_bullets"
        if (self.max_ellipsis_lines_ratio and sum(s.rstrip().endswith(("...", "…")) for s in lines) / len(lines)
                > self.max_ellipsis_lines_ratio):
            return False, "gopher_too_many_end_ellipsis"
        if self.max_non_alpha_words_ratio and n_alpha / n_words < self.max_non_alpha_words_ratio:
            return False, "gopher_below_alpha_threshold"
        if self.min_stop_words and len(self.stop_words.intersection(counts)) < self.min_stop_words:
            return False, "gopher_enough_stop_words"
        return True


class FastC4QualityFilter(C4QualityFilter):
    def filter(self, doc):
        lines = doc.text.splitlines() if self.split_paragraph else split_into_sentences(doc.text, self.language)
        num_sentences = 0
        kept_lines = []
        for line in lines:
            line = line.strip()
            words = line.split()
            if not line.isascii() and NO_SPACE_RE.search(line):
                words = [w for w in split_into_words(line, self.language) if not set(w) <= PUNCTUATION_SET]
            self.stat_update("line-total")
            if self.max_word_length != -1 and max(map(len, words), default=0) > self.max_word_length:
                self.stat_update("line-filter-too_long_word")
                continue
            if self.remove_citations:
                line = CITATION_REGEX.sub("", line)
            if self.filter_no_terminal_punct and (not line.endswith(END_PUNCTUATION) or line.endswith(ELLIPSIS)):
                self.stat_update("line-filter-no_terminal_punc")
                continue
            if len(words) < self.min_words_per_line:
                self.stat_update("line-filter-too_few_words")
                continue
            line_l = line.lower()
            if self.filter_lorem_ipsum and "lorem ipsum" in line_l:
                return False, "lorem_ipsum"
            if self.filter_javascript and "javascript" in line_l:
                self.stat_update("line-filter-javascript")
                continue
            if self.filter_curly_bracket and "{" in line:
                return False, "curly_bracket"
            if self.filter_policy and any(p in line_l for p in POLICY_SUBSTRINGS):
                self.stat_update("line-filter-policy")
                continue
            if self.min_num_sentences != -1 and num_sentences < self.min_num_sentences:  # only compared with it
                num_sentences += len(split_into_sentences(line, self.language)) if self.split_paragraph else 1
            kept_lines.append(line)
            self.stat_update("line-kept")
        if num_sentences < self.min_num_sentences:
            return False, "too_few_sentences"
        doc.text = ("\n" if self.split_paragraph else " ").join(kept_lines).strip()
        return True
