"""Calibrate the per-language thresholds that FineWeb-2's values leave out of line with English on parallel
text: prints the `ADJUST` table of tools/gen_language_settings.py.

Calibration text: the half of the Debian Reference sections whose anchor id hashes even
(`calibration_half`); the other half is the test half that tools/bench/bench_multilingual.py reports on.
For each language and each threshold below, in this order: if the language's own value (FineWeb-2's, or
the chain's) drops a share of the sections for that threshold's reason within 0.02 of English's share for
the same reason on the same sections (5 of ~240 sections), it stays; otherwise it becomes the candidate
whose drop share is closest to English's (the earlier calibrated values applied; ties go to the value
nearest the language's own):
- gopher_quality.max_non_alpha_words_ratio (reason gopher_below_alpha_threshold): words carrying a letter
  per word differ with the word split (Chinese segments into ~1.7-character words, German compounds);
- gopher_quality.min_doc_words (gopher_short_doc): the same content has more words in some languages;
- fineweb.short_line_length (short_line_ratio): a line of Chinese or Japanese says in 30 characters what
  an English one says in ~80;
- fineweb.line_punct_thr (line_punct_ratio) and fineweb.char_duplicates_ratio (char_dup_ratio).
Then one last step on the share of sections kept, which the reasons above leave off when other rules
(repetition, C4) drop different numbers per language: if it is more than 0.02 from English's,
gopher_quality.max_non_alpha_words_ratio (the rule that drops the most) moves to the candidate that brings
it closest. `--final-only` runs that step alone, from the shipped files.

    python tools/bench/calibrate_languages.py [--final-only]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multilingual_corpus import LANGS, calibration_half, reference_sections  # noqa: E402

# (filter type, parameter, reason, candidates)
KNOBS = [
    ("gopher_quality", "max_non_alpha_words_ratio", "gopher_below_alpha_threshold", [x / 100 for x in range(50, 96)]),
    ("gopher_quality", "min_doc_words", "gopher_short_doc", list(range(20, 121, 5))),
    ("fineweb", "short_line_length", "short_line_ratio", list(range(6, 61, 2))),
    ("fineweb", "line_punct_thr", "line_punct_ratio", [x / 100 for x in range(0, 31)]),
    ("fineweb", "char_duplicates_ratio", "char_dup_ratio", [x / 1000 for x in range(5, 101, 5)]),
]


def parallel_docs(half: bool | None = None) -> dict[str, list]:
    """Language → normalised Document per common section (of one half, or all), identified by langid."""
    from datatrove.data import Document

    from datapipe.config import LangIdConfig, NormalizeConfig, SourceConfig
    from datapipe.langid import IdentifyLanguage
    from datapipe.normalize import normalize_text

    secs = {lang: reference_sections(lang) for lang in LANGS}
    ids = [k for k in secs["en"] if all(k in secs[lang] for lang in LANGS)
           and (half is None or calibration_half(k) == half)]
    lid = IdentifyLanguage(LangIdConfig(), SourceConfig("p", ["-"]))
    out = {}
    for lang in LANGS:
        docs = []
        for k in ids:
            d = Document(text=normalize_text(secs[lang][k], NormalizeConfig()), id=f"{lang}/{k}")
            lid.filter(d)
            docs.append(d)
        out[lang] = docs
    return out


def drop_reasons(docs, overrides: dict) -> list[tuple[int, str] | None]:
    """(filter index, reason) of the first filter of the default chain that drops each document (None:
    kept), per-language settings on. Each document is copied first: C4 rewrites the text of those it keeps."""
    from datatrove.data import Document

    from datapipe.config import fineweb_filters
    from datapipe.filters import PerLanguage

    chain = [PerLanguage(spec, "fast", overrides) for spec in fineweb_filters()]
    out = []
    for d in docs:
        d = Document(text=d.text, id=d.id, metadata=dict(d.metadata))
        reason = None
        for i, f in enumerate(chain):
            r = f.filter(d)
            if r is not True and not (isinstance(r, tuple) and r[0]):
                reason = (i, r[1] if isinstance(r, tuple) else "dropped")
                break
        out.append(reason)
    return out


def calibrate(docs: dict[str, list]) -> dict[str, dict[str, dict]]:
    import inspect

    from datapipe.config import fineweb_filters
    from datapipe.filters import _CLASSES
    from datapipe.langsettings import filter_params

    chain = {s.type: s.params for s in fineweb_filters()}

    base = drop_reasons(docs["en"], {})
    adjust: dict[str, dict[str, dict]] = {}
    for lang in LANGS:
        if lang == "en":
            continue
        over: dict[str, dict] = {}
        for ftype, param, reason, cands in KNOBS:
            target = sum(r is not None and r[1] == reason for r in base) / len(base)
            own = filter_params(lang, ftype, chain[ftype], {}).get(
                param, inspect.signature(_CLASSES[ftype].__init__).parameters[param].default)
            trial = {lang: {**over, ftype: {**over.get(ftype, {}), param: own}}}
            at_own = sum(r is not None and r[1] == reason for r in drop_reasons(docs[lang], trial)) / len(docs[lang])
            if abs(at_own - target) <= 0.02:
                print(f"{lang} {ftype}.{param}: {own} kept (drops {at_own:.3f}, English {target:.3f})", flush=True)
                continue
            best = None
            for v in cands:
                trial = {lang: {**over, ftype: {**over.get(ftype, {}), param: v}}}
                got = sum(r is not None and r[1] == reason for r in drop_reasons(docs[lang], trial)) / len(docs[lang])
                key = (round(abs(got - target), 4), abs(v - own))
                if best is None or key < best[0]:
                    best = (key, v, got)
            if best[1] != own:
                over.setdefault(ftype, {})[param] = best[1]
            print(f"{lang} {ftype}.{param}: {own} -> {best[1]} (drops {best[2]:.3f}, English {target:.3f})", flush=True)
        adjust[lang] = over
    return final_step(docs, adjust)


def final_step(docs: dict[str, list], adjust: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    from datapipe.langsettings import filter_params

    def kept(lang: str, over: dict) -> float:
        return sum(r is None for r in drop_reasons(docs[lang], {lang: over} if over else {})) / len(docs[lang])

    target = kept("en", {})
    for lang in LANGS:
        if lang == "en":
            continue
        over = adjust.setdefault(lang, {})
        now = kept(lang, over)
        if abs(now - target) <= 0.02:
            print(f"{lang} kept {now:.3f}, English {target:.3f}: no change", flush=True)
            continue
        own = over.get("gopher_quality", {}).get("max_non_alpha_words_ratio",
                                                  filter_params(lang, "gopher_quality", {}, {})["max_non_alpha_words_ratio"])
        best = None
        for v in [x / 100 for x in range(70, 96)]:
            got = kept(lang, {**over, "gopher_quality": {**over.get("gopher_quality", {}), "max_non_alpha_words_ratio": v}})
            key = (round(abs(got - target), 4), abs(v - own))
            if best is None or key < best[0]:
                best = (key, v, got)
        over.setdefault("gopher_quality", {})["max_non_alpha_words_ratio"] = best[1]
        print(f"{lang} kept {now:.3f} -> {best[2]:.3f} (English {target:.3f}): max_non_alpha_words_ratio {own} -> "
              f"{best[1]}", flush=True)
    return adjust


def main() -> int:
    docs = parallel_docs(half=True)
    print(f"calibration half: {len(docs['en'])} sections per language")
    adjust = final_step(docs, {}) if "--final-only" in sys.argv else calibrate(docs)
    print("ADJUST = " + repr(adjust))
    return 0


if __name__ == "__main__":
    sys.exit(main())
