"""Unicode normalisation of document text (NFC, control characters, whitespace) as a datatrove step.

Per source kind: web text as configured; code keeps the first line's indentation (only blank lines are
stripped at the start); math normalises the text between formulas and keeps every formula byte for byte
(`datapipe.kinds.mathtext`)."""
from __future__ import annotations

import contextlib
import re
import unicodedata

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from datapipe.config import NormalizeConfig

# C0/C1 controls except \t and \n (\r is handled by the newline rule), plus zero-width/BOM characters.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\ufeff]")
_ODD_SPACE = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_TRAILING = re.compile(r"[ \t]+\n")
_BLANKS = re.compile(r"\n{3,}")

_LEADING_BLANK_LINES = re.compile(r"\A(?:[ \t]*\n)+")


def normalize_text(text: str, cfg: NormalizeConfig, kind: str = "web") -> str:
    if kind == "math":
        from datapipe.kinds.mathtext import normalize_outside

        text = normalize_outside(text, lambda t: _normalize(t, cfg, strip=False))
        return text.strip() if cfg.whitespace else text
    if kind == "code" and cfg.whitespace:
        return _LEADING_BLANK_LINES.sub("", _normalize(text, cfg, strip=False)).rstrip()
    return _normalize(text, cfg)


def _normalize(text: str, cfg: NormalizeConfig, strip: bool = True) -> str:
    if cfg.form != "none":
        text = unicodedata.normalize(cfg.form, text)
    if cfg.whitespace:
        text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u2028", "\n").replace("\u2029", "\n\n")
    if cfg.strip_control:
        text = _CONTROL.sub("", text)
    if cfg.whitespace:
        text = _ODD_SPACE.sub(" ", text)
        text = _TRAILING.sub("\n", text)
        text = _BLANKS.sub("\n\n", text)
        if strip:
            text = text.strip()
    return text


class Normalize(PipelineStep):
    """Normalises `doc.text` in place; a document left empty is dropped (counted, written to rejects).
    Rendered conversations (with `loss_spans`) and prompts pass unchanged."""

    name = "🔤 normalize"
    type = "✂️ - FORMAT"

    def __init__(self, cfg: NormalizeConfig, exclusion_writer=None, kinds: dict[str, str] | None = None):
        """`kinds`: source name → kind (web when absent)."""
        super().__init__()
        self.cfg = cfg
        self.exclusion_writer = exclusion_writer
        self.kinds = kinds or {}

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.exclusion_writer or contextlib.nullcontext() as rej:
            for doc in data:
                self.stat_update("total")
                if "loss_spans" in doc.metadata or doc.metadata.get("kind") == "prompts":
                    # a rendered conversation or prompt: its contents were normalised before rendering,
                    # and its spans (or generation prompt) must stay this exact text
                    self.stat_update("forwarded")
                    yield doc
                    continue
                doc.text = normalize_text(doc.text, self.cfg, self.kinds.get(doc.metadata.get("source"), "web"))
                if not doc.text:
                    self.stat_update("dropped", "dropped_empty_after_normalize")
                    if rej is not None:
                        doc.metadata.update(filter="normalize", filter_reason="empty after normalisation")
                        rej.write(doc, rank)
                    continue
                self.stat_update("forwarded")
                yield doc
