"""Write datapipe/assets/languages/*.yaml, the per-language filter settings, from FineWeb-2's configs.

    python tools/gen_language_settings.py PATH/TO/fineweb-2   # a checkout of github.com/huggingface/fineweb-2

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
# measured adjustments on top of FineWeb-2's values (see the module docstring); none so far
ADJUST: dict[str, dict[str, dict]] = {}


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
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(sys.argv[1])
    rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip() or "unknown"
    OUT.mkdir(parents=True, exist_ok=True)
    for lang, name in FINEWEB2.items():
        fw = yaml.safe_load((src / "configs" / f"{name}.yml").read_text(encoding="utf-8"))
        data = convert(fw)
        for ftype, params in ADJUST.get(lang, {}).items():
            data["filters"].setdefault(ftype, {}).update(params)
        write(lang, f"# {lang}: from FineWeb-2's configs/{name}.yml (huggingface/fineweb-2@{rev}) by "
                    "tools/gen_language_settings.py; do not edit by hand.\n", data)
    write("en", "# en: FineWeb's English rules are the chain's own values (datatrove's defaults): nothing changes.\n",
          {"min_score": 0.0, "filters": {}})
    write("default", "# default: languages without settings of their own. Gopher's stop-word rule needs the\n"
                     "# language's stop words, so it is off; every other rule is the chain's.\n",
          {"min_score": 0.0, "filters": {"gopher_quality": {"min_stop_words": 0}}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
