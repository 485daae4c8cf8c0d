"""Real non-English text from Debian's documentation packages, for the multilingual benchmarks and the
small test files under tests/data/multilingual/.

- `reference_sections(lang)`: the Debian Reference (`debian-reference-{en,fr,de,es,it,pt,ja,zh-cn}`), one
  document per section (the text between two headings), keyed by the section's anchor id, which every
  translation shares: parallel text with the same content in each language.
- `heldout_paragraphs(lang)`: paragraphs of the Debian FAQ (`debian-faq`, `debian-faq-*`) and the New
  Maintainers' Guide (`maint-guide`, `maint-guide-*`), plain-text editions: held-out text for language ID
  (nothing is tuned on it).
- `man_paragraphs(lang)`: paragraphs of the translated manual pages (`manpages-ja`, `manpages-zh`), roff
  markup stripped: base documents of the Chinese / Japanese near-duplicate set.

    apt-get install debian-reference-{en,fr,de,es,it,pt,ja,zh-cn} debian-faq debian-faq-{de,fr,it,ja,pt,zh-cn} \\
        maint-guide maint-guide-{de,es,fr,it,ja,zh-cn} manpages-ja manpages-zh
    python tools/bench/multilingual_corpus.py --write-test-data   # rewrites tests/data/multilingual/*
"""
from __future__ import annotations

import argparse
import glob
import gzip
import html.parser
import json
import os
import random
import re
import sys
import unicodedata
import zlib
from pathlib import Path

REFERENCE = Path("/usr/share/doc/debian-reference-common/docs")
FAQ = Path("/usr/share/doc/debian/FAQ")
LANGS = ("en", "fr", "de", "es", "it", "pt", "ja", "zh")
_FILE_LANG = {"zh": "zh-cn"}
REPO = Path(__file__).resolve().parents[2]
TEST_DATA = REPO / "tests" / "data" / "multilingual"
APT = ("debian-reference-{en,fr,de,es,it,pt,ja,zh-cn} debian-faq debian-faq-{de,fr,it,ja,pt,zh-cn} "
       "maint-guide maint-guide-{de,es,fr,it,ja,zh-cn} manpages-ja manpages-zh")


def _wide(c: str) -> bool:
    return unicodedata.east_asian_width(c) in ("W", "F")


def join_wrapped(lines: list[str]) -> str:
    """Re-join the lines of a wrapped paragraph: no space between two CJK characters."""
    out = ""
    for ln in (x.strip() for x in lines):
        if not ln:
            continue
        if out and not (_wide(out[-1]) and _wide(ln[0])):
            out += " "
        out += ln
    return out


class _Sections(html.parser.HTMLParser):
    """Text of an HTML chapter split at h2/h3/h4 headings: paragraphs, list items and table rows one per
    line, <pre> blocks kept line by line."""

    BLOCK = {"p", "li", "tr", "dt", "dd", "h2", "h3", "h4", "title", "div", "pre", "td", "th"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.sections: list[tuple[str, list[str]]] = []
        self.buf: list[str] = []
        self.pre = 0
        self.skip = 0
        self.pending_id: str | None = None

    def _flush(self):
        text = "".join(self.buf)
        self.buf = []
        if not self.sections:
            return
        if self.pre:
            lines = [ln.rstrip() for ln in text.split("\n")]
            self.sections[-1][1].extend(ln for ln in lines if ln.strip())
        else:
            t = join_wrapped(text.split("\n"))
            if t:
                self.sections[-1][1].append(t)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("script", "style"):
            self.skip += 1
        if tag in ("h2", "h3", "h4"):
            self._flush()
            self.pending_id = ""
        if tag == "a" and self.pending_id == "" and a.get("id"):
            self.pending_id = a["id"]
            self.sections.append((a["id"], []))
        if tag in self.BLOCK:
            self._flush()
        if tag == "pre":
            self.pre += 1
        if tag in ("td", "th") and self.buf:
            self.buf.append(" | ")

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self.skip -= 1
        if tag in ("h2", "h3", "h4"):
            self.pending_id = None
        if tag in self.BLOCK and tag not in ("td", "th"):
            self._flush()
        if tag == "pre":
            self.pre -= 1

    def handle_data(self, data):
        if not self.skip:
            self.buf.append(data)


def reference_sections(lang: str) -> dict[str, str]:
    """Section anchor id → section text (heading line first) of the Debian Reference in `lang`."""
    files = sorted(glob.glob(str(REFERENCE / f"*.{_FILE_LANG.get(lang, lang)}.html")))
    if not files:
        raise FileNotFoundError(f"no Debian Reference in {lang!r} under {REFERENCE}: apt-get install {APT}")
    out: dict[str, str] = {}
    for path in files:
        p = _Sections()
        p.feed(Path(path).read_text(encoding="utf-8"))
        p._flush()
        for sid, lines in p.sections:
            text = "\n".join(lines).strip()
            if text and sid not in out:
                out[sid] = text
    return out


def _txt_paragraphs(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        raw = f.read()
    paras = []
    for block in re.split(r"\n\s*\n", raw):
        lines = block.split("\n")
        if any(ln.startswith(("    $", "     ")) and not ln.strip()[:1].isalpha() for ln in lines[:1]):
            pass
        text = join_wrapped(lines)
        text = re.sub(r"\[\d+\]", "", text).strip()
        if len(text) >= 40 and not text.startswith(("*", "+", "$", "#")):
            paras.append(text)
    return paras


_EN_STOP = set("the of and to in is a that for it with as are on be this by".split())


def in_language(text: str, lang: str) -> bool:
    """Whether a paragraph is in `lang`, by script (zh: Han and no kana; ja: kana) or by stop words (at
    least 3 of `lang`'s, more than of any other of LANGS; FineWeb-2's lists, shipped in
    datapipe/assets/languages, and 17 English function words): the label of the held-out set, which no
    language-ID model decides."""
    han = sum("\u4e00" <= c <= "\u9fff" for c in text)
    kana = sum("\u3040" <= c <= "\u30ff" for c in text)
    letters = sum(c.isalpha() for c in text) or 1
    if lang == "zh":
        return han >= 0.5 * letters and kana == 0
    if lang == "ja":
        return kana >= 0.1 * letters and han + kana >= 0.5 * letters
    from datapipe.langsettings import shipped

    stops = {lg: set(shipped()[lg]["filters"]["gopher_quality"]["stop_words"]) for lg in LANGS if lg not in ("en", "zh", "ja")}
    stops["en"] = _EN_STOP
    words = [w.lower() for w in re.findall(r"\w+['’]?", text)]
    count = {lg: sum(w in s or w.rstrip("'’") in s for w in words) for lg, s in stops.items()}
    return count[lang] >= 3 and all(count[lang] > v for lg, v in count.items() if lg != lang)


def heldout_paragraphs(lang: str, clean: bool = False) -> list[str]:
    """Paragraphs of the FAQ and the maintainers' guide in `lang` (English: the originals); `clean`: only
    those `in_language` says are in it (the packages keep some paragraphs untranslated)."""
    fl = _FILE_LANG.get(lang, lang)
    paths = [FAQ / f"debian-faq.{fl}.txt.gz",
             Path(f"/usr/share/doc/maint-guide{'' if lang == 'en' else '-' + fl}/maint-guide.{fl}.txt.gz")]
    paths = [p for p in paths if p.exists()]
    if not paths:
        raise FileNotFoundError(f"no FAQ or maint-guide in {lang!r}: apt-get install {APT}")
    out = [p for path in paths for p in _txt_paragraphs(path)]
    return [p for p in out if in_language(p, lang)] if clean else out


_ROFF_ESC = re.compile(r"\\f[BIRP1-4]|\\f\(..|\\s[-+]?\d|\\\(..|\\[&|^%e]|\\-|\\ ")


def _roff_text(src: str) -> list[str]:
    """Paragraphs of a man page's roff source: requests dropped, font escapes removed."""
    paras, cur = [], []
    for ln in src.split("\n"):
        if ln.startswith((".", "'")):
            req = ln[1:3]
            if req in ("PP", "P ", "LP", "SH", "SS", "TP", "IP", "sp", "br") or ln.strip() in (".P", ".PP", ".LP"):
                if cur:
                    paras.append(join_wrapped(cur))
                cur = []
            continue
        if ln.startswith('.\\"'):
            continue
        cur.append(_ROFF_ESC.sub(lambda m: "-" if m.group() == "\\-" else " " if m.group() == "\\ " else "", ln))
    if cur:
        paras.append(join_wrapped(cur))
    return [p.strip() for p in paras if p.strip()]


def man_paragraphs(lang: str, min_chars: int = 120) -> list[str]:
    """Paragraphs with at least `min_chars` characters, mostly in the page's language, of the translated
    man pages (sections 1 and 8), in sorted file order."""
    folder = {"ja": "ja", "zh": "zh_CN"}[lang]
    files = sorted(glob.glob(f"/usr/share/man/{folder}/man[18]/*.gz"))
    if not files:
        raise FileNotFoundError(f"no {lang} man pages: apt-get install {APT}")
    out, seen = [], set()
    for path in files:
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            src = f.read()
        for p in _roff_text(src):
            wide = sum(_wide(c) for c in p)
            if len(p) >= min_chars and wide >= 0.5 * len(p) and p not in seen:
                seen.add(p)
                out.append(p)
    return out


def calibration_half(section_id: str) -> bool:
    """The Reference sections that calibrate thresholds (tools/bench/calibrate_languages.py); the others
    are the test half."""
    return zlib.crc32(section_id.encode()) % 2 == 0


def write_test_data() -> None:
    """The small files the tests read (tests/data/multilingual/), from the installed packages:
    parallel.jsonl.gz: 40 test-half Debian Reference sections (at most 5000 characters in every language) in each
    of LANGS;
    heldout.jsonl.gz: 40 FAQ / maint-guide paragraphs (>= 80 characters, `in_language`) per language;
    cjk_base.jsonl.gz: 330 man-page paragraphs (150-600 characters) each of Chinese and Japanese."""
    TEST_DATA.mkdir(parents=True, exist_ok=True)
    rng = random.Random(35)
    secs = {lang: reference_sections(lang) for lang in LANGS}
    common = sorted(k for k in secs["en"] if not calibration_half(k)
                    and all(k in secs[lang] and len(secs[lang][k]) <= 5000 for lang in LANGS))
    pick = sorted(rng.sample(common, 40))
    rows = [{"id": f"{lang}/{k}", "section": k, "language": lang, "text": secs[lang][k]} for k in pick for lang in LANGS]
    _write(TEST_DATA / "parallel.jsonl.gz", rows)
    rows = []
    for lang in LANGS:
        paras = [p for p in heldout_paragraphs(lang, clean=True) if len(p) >= 80]
        rows += [{"id": f"{lang}/{i}", "language": lang, "text": p} for i, p in enumerate(rng.sample(paras, 40))]
    _write(TEST_DATA / "heldout.jsonl.gz", rows)
    rows = []
    for lang in ("zh", "ja"):
        paras = [p for p in man_paragraphs(lang, 150) if len(p) <= 600]
        rows += [{"id": f"{lang}/{i}", "language": lang, "text": p} for i, p in enumerate(rng.sample(paras, 330))]
    _write(TEST_DATA / "cjk_base.jsonl.gz", rows)


def _write(path: Path, rows: list[dict]) -> None:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    with open(path, "wb") as f:
        f.write(gzip.compress(data, 9, mtime=0))
    print(f"wrote {path} ({len(rows)} rows, {os.path.getsize(path) / 1024:.0f} KB)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-test-data", action="store_true")
    args = ap.parse_args()
    if args.write_test_data:
        write_test_data()
        return 0
    for lang in LANGS:
        print(lang, len(reference_sections(lang)), "sections,", len(heldout_paragraphs(lang)), "held-out paragraphs")
    for lang in ("zh", "ja"):
        print(lang, len(man_paragraphs(lang)), "man-page paragraphs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
