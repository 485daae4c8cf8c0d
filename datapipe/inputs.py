"""The build's task inputs: the files of every source's paths and globs (any fsspec URL), split into pieces
(byte ranges of a large JSONL file, row-group ranges of a Parquet file) or, for a code source of many small
text files, grouped into pieces of several files, in a global order that never depends on the workers.
A path naming a Hugging Face dataset folder (`datasets` save_to_disk, Hub-style Parquet) stands for its
files (`datapipe.hfdata`); each Arrow file of a save_to_disk folder is one piece.

Every piece is one task (its rank is its position in the global list). Parquet and Arrow schemas and JSONL
text fields are checked here, before any stage runs, so a wrong field name fails once, naming the file.
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import json
import posixpath
from dataclasses import dataclass

import fsspec

from datapipe.config import SourceConfig
from datapipe.hfdata import COLUMNAR, FOLDER_FORMATS, SAVED_MARKERS, arrow_columns, folder_files, folder_format


class InputError(RuntimeError):
    """An input file that cannot be read on; the message names the file and where it broke."""


@dataclass(frozen=True)
class InputFile:
    """One task's input: a whole file, or a piece of a large one (JSONL: bytes [start, end), a record
    belonging to the piece its line starts in; Parquet: row groups [start, end), `first_row` rows before)."""
    source: str
    url: str
    fmt: str  # jsonl | parquet | arrow | text | chat | preference | prompts
    start: int = 0
    end: int | None = None  # None: to the end of the file
    first_row: int = 0
    rel: str = ""  # the path relative to the folder of the pattern that matched it (the id of a code file)
    more: tuple[tuple[str, str], ...] = ()  # a code source's text files: further (url, rel) read by this task

    @property
    def members(self) -> tuple[tuple[str, str], ...]:
        return ((self.url, self.rel),) + self.more

    @property
    def split(self) -> bool:
        """A JSONL piece of a split file: records are located by byte offset, not line number."""
        return self.fmt not in COLUMNAR and (self.start > 0 or self.end is not None)


def _detect(url: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = url.lower()
    for ext in (".gz", ".zst", ".zstd"):
        name = name.removesuffix(ext)
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return "text"


def expand_sources(sources: list[SourceConfig], max_task_bytes: int | None = None) -> list[InputFile]:
    """The build's global, ordered task inputs (source priority order, then sorted paths, then pieces).

    Uncompressed JSONL files larger than `max_task_bytes` are split into byte ranges and Parquet files
    into groups of row groups, so one large file runs on several cores. Parquet and Arrow schemas are read
    here: a source whose text field is not a column fails before anything runs. Fails fast, naming the path,
    when a path or glob matches nothing (or a folder holds no dataset layout, split or subset named)."""
    files: list[InputFile] = []
    for src in sources:
        first = len(files)
        seen: set[str] = set()
        sizes: dict[str, int] = {}
        for pattern in src.paths:
            fsys, _, paths = fsspec.get_fs_token_paths(pattern)
            proto = fsys.protocol if isinstance(fsys.protocol, str) else fsys.protocol[0]
            base = _glob_base(fsys._strip_protocol(pattern))
            local = proto in ("file", "local")
            found: list[tuple[str, str, str]] = []  # (path, file format, the folder its id is relative to)
            for p in sorted(paths):
                url = p if local else f"{proto}://{p}"
                if fsys.isdir(p):
                    layout = _folder_layout(fsys, p, pattern, src)
                    if layout:
                        found += [(q, fmt, p) for q, fmt in folder_files(fsys, p, url, layout, src)]
                elif src.format not in FOLDER_FORMATS:
                    found.append((p, _detect(url, src.format), base))
                elif not _is_glob(pattern):  # a glob's files beside the folders it matches are not read
                    raise FileNotFoundError(f"source {src.name!r}: format {src.format} reads a folder, and "
                                            f"{url} is a file")
            if not found:
                raise FileNotFoundError(f"source {src.name!r}: path {pattern!r} matches no readable file")
            for p, fmt, root in found:
                url = p if local else f"{proto}://{p}"
                if url not in seen:
                    seen.add(url)
                    rel = posixpath.relpath(p, root) if root and p != root else posixpath.basename(p)
                    whole = InputFile(src.name, url, fmt, rel=rel)
                    if fmt == "parquet":
                        files += _parquet_pieces(whole, src, max_task_bytes)
                    elif fmt == "arrow":
                        files.append(_arrow_checked(whole, src))
                    else:
                        sizes[url] = fsys.size(p)
                        files += _byte_pieces(whole, sizes[url], max_task_bytes)
        if src.kind == "code":
            files[first:] = _group_files(files[first:], sizes, max_task_bytes)
    return files


def _folder_layout(fsys, path: str, pattern: str, src: SourceConfig) -> str | None:
    """save_to_disk or hub_parquet when the folder `path` is read as one: with such a `format:`, any folder
    the pattern matches; with `format: auto`, a pattern naming a folder (no glob), whose layout must be one."""
    if src.format not in FOLDER_FORMATS + ("auto",):
        return None
    if src.format != "auto":
        return src.format
    if _is_glob(pattern):
        return None  # a glob's folders (a code tree's): skipped, as before
    layout = folder_format(fsys, path, src.subset)
    if layout is None:
        raise FileNotFoundError(f"source {src.name!r}: path {pattern!r} is a folder with neither a datasets "
                                f"save_to_disk layout ({', '.join(SAVED_MARKERS)}) nor a Hub Parquet layout "
                                f"(data/*.parquet); name its files with a glob, e.g. {pattern.rstrip('/')}/*.jsonl")
    return layout


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _group_files(files: list[InputFile], sizes: dict[str, int], max_bytes: int | None,
                 max_files: int = 4096) -> list[InputFile]:
    """A code source's text files (one document each) read together by tasks of up to `max_bytes` (and
    `max_files`), in order, so a tree of small files is not a task (and a shard) per file; other pieces stay."""
    out: list[InputFile] = []
    size = 0
    for f in files:
        prev = out[-1] if out else None
        n = sizes.get(f.url, 0)
        if f.fmt != "text" or prev is None or prev.fmt != "text" or len(prev.members) >= max_files or \
                (max_bytes is not None and size + n > max_bytes):
            out.append(f)
            size = n
        else:
            out[-1] = dataclasses.replace(prev, more=prev.more + ((f.url, f.rel),))
            size += n
    return out


def _glob_base(path: str) -> str:
    """The folder part of a pattern before its first glob character (`a/b/**/*.py` → `a/b`)."""
    cut = min((path.find(c) for c in "*?[" if c in path), default=-1)
    if cut < 0:
        return posixpath.dirname(path)
    return posixpath.dirname(path[:cut])


def _byte_pieces(f: InputFile, size: int, max_bytes: int | None) -> list[InputFile]:
    compressed = f.url.lower().endswith((".gz", ".zst", ".zstd"))
    if max_bytes is None or size <= max_bytes or compressed or f.fmt == "text":
        return [f]
    n = -(-size // max_bytes)
    bounds = [size * k // n for k in range(n + 1)]
    return [InputFile(f.source, f.url, f.fmt, a, b if k < n - 1 else None, rel=f.rel)
            for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def _parquet_pieces(f: InputFile, src: SourceConfig, max_bytes: int | None) -> list[InputFile]:
    """Checks the schema (the text field must be a column) and groups row groups into pieces."""
    import pyarrow.parquet as pq

    try:
        with fsspec.open(f.url, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
    except Exception as e:  # noqa: BLE001 - an unreadable footer: one line naming the file
        raise ValueError(f"{f.url}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    names = meta.schema.to_arrow_schema().names
    if src.text_field not in names:
        raise KeyError(f"source {src.name!r}: text field {src.text_field!r} is not a column of {f.url} "
                       f"(columns: {', '.join(names)})")
    pieces, start, row, first_row, size = [], 0, 0, 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        if max_bytes is not None and size and size + rg.total_byte_size > max_bytes:
            pieces.append(InputFile(f.source, f.url, f.fmt, start, g, first_row, f.rel))
            start, first_row, size = g, row, 0
        size += rg.total_byte_size
        row += rg.num_rows
    if not pieces:
        return [f]
    return pieces + [InputFile(f.source, f.url, f.fmt, start, None, first_row, f.rel)]


def _arrow_checked(f: InputFile, src: SourceConfig) -> InputFile:
    """An Arrow file whose schema holds the text field (one piece: a stream has no index to split it by)."""
    names = arrow_columns(f.url)
    if src.text_field not in names:
        raise KeyError(f"source {src.name!r}: text field {src.text_field!r} is not a column of {f.url} "
                       f"(columns: {', '.join(names)})")
    return f


def open_binary(url: str) -> io.BufferedIOBase:
    f = fsspec.open(url, "rb").open()
    low = url.lower()
    if low.endswith(".gz"):
        return gzip.GzipFile(fileobj=f)
    if low.endswith((".zst", ".zstd")):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True))
    return f


def check_fields(files: list[InputFile], sources: dict[str, SourceConfig], probe: int = 50) -> None:
    """Fail fast when a source's text field appears in none of the first records of its first file
    (a wrong field name would otherwise reject every document one by one)."""
    checked: set[str] = set()
    for f in files:
        if f.source in checked or f.fmt not in ("jsonl", "chat", "preference", "prompts"):
            continue
        checked.add(f.source)
        src = sources[f.source]
        want = {"chat": ("messages", "prompt"), "preference": ("chosen",), "prompts": ("prompt", "messages")}.get(
            f.fmt, (src.text_field,))
        seen_fields: set[str] = set()
        n = 0
        with open_binary(f.url) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    n += 1
                    seen_fields.update(rec)
                    if any(k in rec for k in want):
                        break
                if n >= probe:
                    break
        if n and not seen_fields & set(want):
            what = {"chat": "fields 'messages' or 'prompt'", "preference": "field 'chosen'",
                    "prompts": "fields 'prompt' or 'messages'"}.get(f.fmt, f"text field {src.text_field!r}")
            raise KeyError(f"source {f.source!r}: {what} not found in the first {n} records "
                           f"of {f.url} (fields there: {', '.join(sorted(seen_fields))})")
