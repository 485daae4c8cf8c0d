"""Read raw documents of one task's input (`datapipe.inputs`: JSONL .gz/.zst, Parquet, Arrow files of a
`datasets` save_to_disk folder, plain text files) as a datatrove step. Bad records never stop a build: a
malformed JSONL line, bytes that are not UTF-8, a missing (in Parquet or Arrow: null) or non-string text
field, an empty or oversized document are written to `rejects/read/` with file, line (Parquet and Arrow:
row; a piece of a split JSONL file: byte offset) and reason, and counted. Parquet and Arrow files are read
one record batch at a time (`datapipe.hfdata.record_batches`).

A `format: chat` source is JSONL of conversations: each record is checked (`storage.chat`), its message
contents normalised, and it is rendered by the source's chat template when read; the document's text is
the rendered conversation (so dedup runs on it unchanged) and `metadata["loss_spans"]` holds the
character spans that carry loss. A bad conversation is rejected with its reason code, counted as
`dropped_read` and `dropped_read:<reason>`. A `format: preference` source is JSONL of preference pairs,
read into one document per pair (`datapipe.preference`); a `format: prompts` source is JSONL of RL prompts,
each rendered up to the generation prompt (`datapipe.prompts`).

A `kind: code` source gives each document `path` (a `format: text` file's path relative to its pattern's
folder, which is also its id; else the record's path field) and, from the record's fields
(`kinds.code.fields`), `declared_language`, `repo` and `license`. A file holding a NUL character is
rejected as binary; the rejects of a source that redacts are redacted too (`datapipe.kinds.redact`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from storage.chat import ConversationError, render, validate_conversation
from datapipe.config import NormalizeConfig, SourceConfig
from datapipe.hfdata import COLUMNAR, record_batches
from datapipe.inputs import InputError, InputFile, open_binary
from datapipe.kinds.config import CodeFields
from datapipe.normalize import normalize_text
from datapipe.preference import read_pair
from datapipe.prompts import read_prompt
from datapipe.rejects import RejectsWriter


class SourceReader(PipelineStep):
    """Task `rank` reads `files[rank]`; yields normalisable `Document`s with source/file/line metadata."""

    name = "📖 smoltrain source reader"
    type = "📖 - READER"

    def __init__(self, files: list[InputFile], sources: dict[str, SourceConfig], rejects: str | None,
                 max_chars: int, normalize: NormalizeConfig | None = None, chat_template: str | None = None,
                 code_fields: CodeFields | None = None, redactors: dict | None = None):
        """`rejects` None: a re-read of input already checked once; bad records are skipped silently.
        `redactors`: source name → `datapipe.kinds.redact.Redactor`, applied to that source's rejects."""
        super().__init__()
        self.files, self.sources, self.max_chars = files, sources, max_chars
        self.rejects = rejects
        self.code_fields, self.redactors = code_fields or CodeFields(), redactors or {}
        self.normalize, self.chat_template = normalize or NormalizeConfig(form="none", strip_control=False,
                                                                          whitespace=False), chat_template

    def _reject_writer(self):
        if self.rejects is None:
            return contextlib.nullcontext(None)
        return RejectsWriter(os.path.join(self.rejects, "read"))

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        f = self.files[rank]
        src = self.sources[f.source]
        with self._reject_writer() as rej:
            for lineno, text, doc_id, err, *extra in self._records(f, src):
                self.stat_update("read")
                meta = {"source": f.source, "file": f.url, _where_key(f): lineno}
                if isinstance(err, ConversationError):
                    self.stat_update(f"dropped_read:{err.reason}")
                    err = str(err)
                elif extra and (err is None or f.fmt == "text"):  # a text file's name, even when it is bad
                    meta.update(extra[0])
                if src.kind == "code":
                    if err is None and "\x00" in text:
                        err = f"binary file (a NUL character at offset {text.index(chr(0)):,})"
                if err is None:
                    if not text.strip():
                        err = "empty document"
                    elif len(text) > self.max_chars:
                        err = f"document has {len(text):,} characters, more than max_chars={self.max_chars:,}"
                if err is not None:
                    self.stat_update("dropped_read")
                    if rej is None:
                        continue
                    keep = text if isinstance(text, str) and len(text) <= 10_000 else (text or "")[:10_000]
                    if f.source in self.redactors:  # the reject keeps a redacted copy, never the original
                        keep = self.redactors[f.source].redact(keep.replace("\x00", ""), meta.get("path") or "")[0]
                    rej.write(Document(text=keep, id=doc_id or f"{f.url}:{lineno}",
                                       metadata={**meta, "filter": "read", "filter_reason": err}), rank)
                    continue
                yield Document(text=text, id=doc_id, metadata=meta)

    def _records(self, f: InputFile, src: SourceConfig):
        """(line or row number, text, id, error or None) for every record of one file; a file that cannot
        be read on (truncated or corrupt compression, an I/O error) stops the task with one line naming
        it and the last record read, since its remaining records would otherwise be lost silently."""
        where = "its start"
        try:
            for rec in self._raw_records(f, src):
                where = f"{'byte offset' if f.split else _where_key(f)} {rec[0]}"
                yield rec
        except (OSError, EOFError, ValueError) as e:
            if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
                raise
            raise InputError(f"{f.url}: unreadable after {where} ({type(e).__name__}: {e})") from None

    def _raw_records(self, f: InputFile, src: SourceConfig):
        base = os.path.basename(f.url)
        if f.fmt in COLUMNAR:
            yield from self._columnar(f, src, base)
            return
        if f.fmt == "text":
            yield from self._text_files(f, src)
            return
        with open_binary(f.url) as fh:
            for lineno, line in _lines(fh, f):
                fallback_id = f"{f.source}/{base}{'@' if f.split else ':'}{lineno}"
                try:
                    s = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield lineno, line.decode("utf-8", "replace"), fallback_id, f"not UTF-8 at byte {e.start}"
                    continue
                if not s.strip():
                    continue
                try:
                    rec = json.loads(s)
                except json.JSONDecodeError as e:
                    yield lineno, s, fallback_id, f"malformed JSON ({e.msg} at column {e.colno})"
                    continue
                if f.fmt == "chat":
                    yield (lineno, *self._from_chat(rec, src, fallback_id))
                elif f.fmt == "preference":
                    yield (lineno, *self._from_preference(rec, src, fallback_id))
                elif f.fmt == "prompts":
                    yield (lineno, *self._from_prompt(rec, src, fallback_id))
                else:
                    yield (lineno, *self._from_record(rec, src, fallback_id))

    def _text_files(self, f: InputFile, src: SourceConfig):
        """One document per file: (number in the piece, text, id, error, {file; a code file's path})."""
        for k, (url, rel) in enumerate(f.members, start=1):
            try:
                with open_binary(url) as fh:
                    raw = fh.read()
            except OSError as e:  # the piece's first file is named by _records; a later one here
                raise InputError(f"{url}: unreadable ({type(e).__name__}: {e})") from None
            code = src.kind == "code"
            doc_id = f"{f.source}/{rel if code else os.path.basename(url)}"
            where = {"file": url, **({"path": rel} if code else {})}
            try:
                yield k, raw.decode("utf-8"), doc_id, None, where
            except UnicodeDecodeError as e:
                yield k, raw.decode("utf-8", "replace"), doc_id, f"not UTF-8 at byte {e.start}", where

    def _from_chat(self, rec, src: SourceConfig, fallback_id: str) -> tuple:
        """(rendered text, id, None, {"loss_spans", "kind"}) or ("", id, ConversationError)."""
        doc_id = fallback_id
        if isinstance(rec, dict) and src.id_field and rec.get(src.id_field) is not None:
            doc_id = f"{src.name}/{rec[src.id_field]}"
        try:
            msgs = validate_conversation(rec, train_on=src.chat.train_on)
        except ConversationError as e:
            return json.dumps(rec, ensure_ascii=False)[:10_000], doc_id, e
        for m in msgs:
            for k in ("content", "reasoning_content"):
                if k in m:
                    m[k] = normalize_text(m[k], self.normalize)
        assert self.chat_template is not None, "chat sources need the build's chat template"
        try:
            text, spans = render(self.chat_template, msgs, train_on=src.chat.train_on, **src.chat.template_vars)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception or a bad value: one bad record
            return "", doc_id, ConversationError("template_error", f"{type(e).__name__}: {e}")
        if not any(b > a for a, b in spans):
            return text, doc_id, ConversationError("no_loss_tokens", "the template marked no text for loss")
        return text, doc_id, None, {"kind": "chat", "loss_spans": [list(sp) for sp in spans]}

    def _from_preference(self, rec, src: SourceConfig, fallback_id: str) -> tuple:
        """(chosen + rejected rendered text, pair id, None, metadata) or (record, id, ConversationError)."""
        doc_id = fallback_id
        if isinstance(rec, dict) and src.id_field and rec.get(src.id_field) is not None:
            doc_id = f"{src.name}/{rec[src.id_field]}"
        assert self.chat_template is not None, "preference sources need the build's chat template"
        try:
            text, meta = read_pair(rec, self.chat_template, src.chat, self.normalize)
        except ConversationError as e:
            return json.dumps(rec, ensure_ascii=False)[:10_000], doc_id, e
        return text, doc_id, None, meta

    def _from_prompt(self, rec, src: SourceConfig, fallback_id: str) -> tuple:
        """(rendered prompt, id, None, metadata) or (record, id, ConversationError)."""
        doc_id = fallback_id
        if isinstance(rec, dict) and src.id_field and rec.get(src.id_field) is not None:
            doc_id = f"{src.name}/{rec[src.id_field]}"
        assert self.chat_template is not None, "prompts sources need the build's chat template"
        try:
            text, meta = read_prompt(rec, self.chat_template, src.chat, self.normalize, src.id_field)
        except ConversationError as e:
            return json.dumps(rec, ensure_ascii=False)[:10_000], doc_id, e
        return text, doc_id, None, meta

    def _from_record(self, rec, src: SourceConfig, fallback_id: str) -> tuple:
        if not isinstance(rec, dict):
            return "", fallback_id, f"record is a JSON {type(rec).__name__}, not an object"
        doc_id = fallback_id
        if src.id_field and rec.get(src.id_field) is not None:
            doc_id = f"{src.name}/{rec[src.id_field]}"
        if src.text_field not in rec:
            return "", doc_id, f"missing text field {src.text_field!r} (fields: {', '.join(sorted(rec))[:200]})"
        text = rec[src.text_field]
        if not isinstance(text, str):
            return "", doc_id, f"text field {src.text_field!r} is a {type(text).__name__}, not a string"
        if src.kind == "code":
            return text, doc_id, None, self._code_meta(rec)
        return text, doc_id, None

    def _code_meta(self, rec: dict) -> dict:
        """A code record's path, declared language, repository and licence (the fields it has)."""
        fields, out = self.code_fields, {}
        for key, name in (("path", fields.path), ("declared_language", fields.language), ("repo", fields.repo),
                          ("license", fields.license)):
            value = rec.get(name) if name else None
            if isinstance(value, str) and value or key == "license" and isinstance(value, list) and value:
                out[key] = value if isinstance(value, str) else [str(v) for v in value]
        return out

    def _columnar(self, f: InputFile, src: SourceConfig, base: str):
        """The rows of a Parquet or Arrow file as records of the columns a source reads; a null value is a
        missing field, as a key absent from a JSONL record."""
        want = [src.text_field, src.id_field, *(dataclasses.astuple(self.code_fields) if src.kind == "code" else ())]
        row = f.first_row
        for batch in record_batches(f.url, f.fmt, list(dict.fromkeys(c for c in want if c)), f.start, f.end):
            cols = batch.to_pydict()
            for i in range(batch.num_rows):
                row += 1
                rec = {c: v[i] for c, v in cols.items() if v[i] is not None}
                yield (row, *self._from_record(rec, src, f"{src.name}/{base}:{row}"))


def _where_key(f: InputFile) -> str:
    """The metadata key of a record's place in its file: offset (a piece of a split JSONL file), row, line."""
    return "offset" if f.split else "row" if f.fmt in COLUMNAR else "line"


def _lines(fh, f: InputFile):
    """(line number, line) of a whole file, or (byte offset, line) of the records starting in a piece."""
    if not f.split:
        yield from enumerate(fh, start=1)
        return
    pos = f.start
    if pos > 0:
        fh.seek(pos - 1)
        pos += len(fh.readline()) - 1  # the line running through `start` belongs to the previous piece
    while f.end is None or pos < f.end:
        line = fh.readline()
        if not line:
            return
        yield pos, line
        pos += len(line)
