"""Write datapipe/assets/languages/*.yaml, the per-language filter settings, from FineWeb-2's configs.

    python tools/gen_language_settings.py PATH/TO/fineweb-2 [REV]   # a checkout of github.com/huggingface/fineweb-2

How a FineWeb-2 config `configs/{iso3}_{script}.yml` becomes ours (FineWeb-2's pipeline,
`fineweb-2-pipeline.py`, passes the same keys to the same datatrove filters):
- `min_score` ← `language_score` (FineWeb-2 drops documents below it; here it only decides from which
  score a document is judged by its language's settings);
- gopher_repetition: `dup_line_frac`, `top_n_grams`, `dup_n_grams` as given;
- gopher_quality: `stop_words` ← `stopwords` (plus each word with `'` also written with `’`, since the
  word split keeps the apostrophe it finds), `min_stop_words: 2` (FineWeb-2's value),
  `min_avg_word_length`, `max_avg_word_length`, `max_non_alpha_words_ratio` as given;
- fineweb: `line_punct_thr`, `new_line_ratio` as given.
FineWeb-2's global changes to the English rules (paragraph repetition rules off, `short_line_thr` off,
`char_duplicates_ratio` 0.1, no C4 filter) are not copied: they apply to every language alike, and the
build's chain (FineWeb's English rules by default) decides them for all languages. Where a language's
measured kept share on parallel text (tools/bench/bench_multilingual.py) needed more, `ADJUST` below
says what and why.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "datapipe" / "assets" / "languages"
FINEWEB2 = {"fr": "fra_Latn", "es": "spa_Latn", "de": "deu_Latn", "it": "ita_Latn", "pt": "por_Latn",
            "zh": "cmn_Hani", "ja": "jpn_Jpan"}
# Measured adjustments on top of FineWeb-2's values: the output of tools/bench/calibrate_languages.py
# (thresholds whose drop share on the calibration half of the Debian Reference sections was more than
# 0.02 away from English's, moved to the candidate closest to it; then, where the share of sections kept
# was still more than 0.02 away, the alphabetic-word ratio: Japanese 0.82 -> 0.83). Chinese and Japanese segment into short
# words (more words per sentence), so FineWeb's 30-character short line and FineWeb-2's lower
# alphabetic-word ratios kept far more of the same content than English keeps.
ADJUST: dict[str, dict[str, dict]] = {
    "fr": {"gopher_quality": {"max_non_alpha_words_ratio": 0.82}},
    "de": {"gopher_quality": {"max_non_alpha_words_ratio": 0.76}, "fineweb": {"line_punct_thr": 0.03}},
    "es": {"gopher_quality": {"max_non_alpha_words_ratio": 0.82}, "fineweb": {"line_punct_thr": 0.12}},
    "it": {"gopher_quality": {"max_non_alpha_words_ratio": 0.82}, "fineweb": {"line_punct_thr": 0.12}},
    "pt": {"gopher_quality": {"max_non_alpha_words_ratio": 0.81}},
    "ja": {"gopher_quality": {"max_non_alpha_words_ratio": 0.83, "min_doc_words": 60}, "fineweb": {"short_line_length": 14}},
    "zh": {"gopher_quality": {"max_non_alpha_words_ratio": 0.78}, "fineweb": {"short_line_length": 10}},
}


def convert(fw: dict) -> dict:
    stop = list(fw["stopwords"])
    stop += [w.replace("'", "’") for w in stop if "'" in w]
    return {
        "min_score": fw["language_score"],
        "filters": {
            "gopher_repetition": {"dup_line_frac": fw["dup_line_frac"], "top_n_grams": fw["top_n_grams"],
                                  "dup_n_grams": fw["dup_n_grams"]},
            "gopher_quality": {"stop_words": stop, "min_stop_words": 2,
                               "min_avg_word_length": fw["min_avg_word_length"],
                               "max_avg_word_length": fw["max_avg_word_length"],
                               "max_non_alpha_words_ratio": fw["max_non_alpha_words_ratio"]},
            "fineweb": {"line_punct_thr": fw["line_punct_thr"], "new_line_ratio": fw["new_line_ratio"]},
        },
    }


def write(name: str, header: str, data: dict) -> None:
    text = header + yaml.safe_dump(data, allow_unicode=True, sort_keys=False, default_flow_style=None, width=110)
    (OUT / f"{name}.yaml").write_text(text, encoding="utf-8")
    print(f"wrote {OUT / f'{name}.yaml'}")


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(sys.argv[1])
    rev = (sys.argv[2] if len(sys.argv) > 2 else
           subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown")
    OUT.mkdir(parents=True, exist_ok=True)
    for lang, name in FINEWEB2.items():
        fw = yaml.safe_load((src / "configs" / f"{name}.yml").read_text(encoding="utf-8"))
        data = convert(fw)
        for ftype, params in ADJUST.get(lang, {}).items():
            data["filters"].setdefault(ftype, {}).update(params)
        adjusted = ", ".join(f"{t}.{k}" for t, ps in ADJUST.get(lang, {}).items() for k in ps)
        write(lang, f"# {lang}: from FineWeb-2's configs/{name}.yml (huggingface/fineweb-2@{rev}) by "
                    "tools/gen_language_settings.py; do not edit by hand.\n"
                    + (f"# calibrated on parallel text (tools/bench/calibrate_languages.py): {adjusted}\n" if adjusted
                       else ""), data)
    write("en", "# en: FineWeb's English rules are the chain's own values (datatrove's defaults): nothing changes.\n",
          {"min_score": 0.0, "filters": {}})
    write("default", "# default: languages without settings of their own. Gopher's stop-word rule needs the\n"
                     "# language's stop words, so it is off; every other rule is the chain's.\n",
          {"min_score": 0.0, "filters": {"gopher_quality": {"min_stop_words": 0}}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
