"""Hugging Face dataset folders as build inputs, and the rows of the columnar files they hold.

A `datasets` `save_to_disk` folder is Arrow stream files (`data-00000-of-0000N.arrow`) in the order of
`state.json`'s `_data_files` (a `DatasetDict`'s folder: the `split` subfolder named in
`dataset_dict.json`). A Hub-style Parquet folder is `data/SPLIT-*.parquet` (what `push_to_hub` writes),
or the same under a subset's (config's) folder, `SUBSET/SPLIT-*.parquet`, or `SUBSET/SPLIT/*.parquet`
(the Hub's Parquet conversion). `folder_files` resolves either to its files; `record_batches` reads one
Parquet or Arrow file a record batch at a time through fsspec, so any URL works and memory stays at one
batch.
"""
from __future__ import annotations

import json
import posixpath
import re

import fsspec

from storage.config import ConfigError

FOLDER_FORMATS = ("save_to_disk", "hub_parquet")  # `format:` values that name a folder, not files
COLUMNAR = ("parquet", "arrow")  # file formats read as record batches; records are numbered by row
SAVED_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")


def _names(fsys, path: str) -> set[str]:
    return {posixpath.basename(p.rstrip("/")) for p in fsys.ls(path, detail=False)}


def _read_json(fsys, path: str, url: str):
    try:
        with fsys.open(path, "rb") as fh:
            return json.loads(fh.read())
    except json.JSONDecodeError as e:
        raise ValueError(f"{url}: not valid JSON ({e})") from None


def folder_format(fsys, path: str, subset: str | None) -> str | None:
    """The layout a folder holds (`format: auto`): save_to_disk when it has state.json, dataset_info.json
    or dataset_dict.json; hub_parquet when it has a `data/` folder (or the source's `subset` folder)."""
    names = _names(fsys, path)
    if names & set(SAVED_MARKERS):
        return "save_to_disk"
    if "data" in names or subset and subset in names:
        return "hub_parquet"
    return None


def folder_files(fsys, path: str, url: str, layout: str, src) -> list[tuple[str, str]]:
    """(path, file format) of the files of a `layout` folder at `path` (shown as `url`), in reading order;
    a split or subset the folder lacks is a ConfigError naming the key and what the folder has."""
    if layout == "save_to_disk":
        return [(p, "arrow") for p in _saved_files(fsys, path, url, src)]
    return [(p, "parquet") for p in _hub_files(fsys, path, url, src)]


def _saved_files(fsys, path: str, url: str, src) -> list[str]:
    names = _names(fsys, path)
    if "dataset_dict.json" in names:  # DatasetDict.save_to_disk: one save_to_disk folder per split
        splits = _read_json(fsys, posixpath.join(path, "dataset_dict.json"), f"{url}/dataset_dict.json")
        splits = splits.get("splits", []) if isinstance(splits, dict) else []
        if src.split not in splits:
            raise ConfigError(f"source {src.name!r}: key 'split': {src.split!r} is not a split of {url} "
                              f"(splits: {', '.join(map(str, splits))})")
        path, url = posixpath.join(path, src.split), f"{url}/{src.split}"
        names = _names(fsys, path)
    if "state.json" not in names:
        raise FileNotFoundError(f"source {src.name!r}: {url} has no state.json, so it is not a datasets "
                                "save_to_disk folder (Dataset.save_to_disk writes one beside its .arrow files)")
    state = _read_json(fsys, posixpath.join(path, "state.json"), f"{url}/state.json")
    try:
        files = [d["filename"] for d in state["_data_files"]]
    except (KeyError, TypeError):
        raise ValueError(f"{url}/state.json: no '_data_files' list of {{filename: ...}} entries") from None
    if not files:
        raise FileNotFoundError(f"source {src.name!r}: {url}/state.json lists no data files")
    return [posixpath.join(path, f) for f in files]


def _hub_files(fsys, path: str, url: str, src) -> list[str]:
    names = _names(fsys, path)
    sub = src.subset or next((n for n in ("data", "default") if n in names), None)
    if sub is None or sub not in names:
        folders = ", ".join(sorted(n for n in names if fsys.isdir(posixpath.join(path, n))))
        what = f"no folder {sub!r}" if sub else "no data/ folder; name a subset folder"
        raise ConfigError(f"source {src.name!r}: key 'subset': {url} has {what} (folders: {folders})")
    base = posixpath.join(path, sub)
    rels = sorted(posixpath.relpath(p, base) for p in fsys.find(base) if p.endswith(".parquet"))
    ours = re.compile(rf"{re.escape(src.split)}(-[^/]*)?\.parquet|{re.escape(src.split)}/[^/]+\.parquet")
    files = [posixpath.join(base, r) for r in rels if ours.fullmatch(r)]
    if not files:
        splits = sorted({re.split(r"[-/]", r.removesuffix(".parquet"), maxsplit=1)[0] for r in rels})
        raise ConfigError(f"source {src.name!r}: key 'split': {src.split!r} has no Parquet files in {url}/{sub} "
                          f"(SPLIT-*.parquet or SPLIT/*.parquet; splits there: {', '.join(splits)})")
    return files


def arrow_columns(url: str) -> list[str]:
    """The column names of an Arrow stream file (its schema message only); ValueError naming it if unreadable."""
    import pyarrow as pa

    try:
        with fsspec.open(url, "rb") as fh:
            return pa.ipc.open_stream(fh).schema.names
    except Exception as e:  # noqa: BLE001 - a missing or corrupt file: one line naming it
        raise ValueError(f"{url}: not a readable Arrow stream file, as datasets' save_to_disk writes "
                         f"({type(e).__name__}: {e})") from None


def record_batches(url: str, fmt: str, columns: list[str], start: int = 0, end: int | None = None,
                   batch_size: int = 4096):
    """The record batches of one Parquet file (row groups [start, end)) or Arrow stream file, one at a time,
    holding those of `columns` the file has, in that order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fsspec.open(url, "rb") as fh:
        if fmt == "parquet":
            pf = pq.ParquetFile(fh)
            cols = [c for c in columns if c in pf.schema_arrow.names]
            groups = range(start, pf.num_row_groups if end is None else end)
            yield from pf.iter_batches(columns=cols, batch_size=batch_size, row_groups=groups)
            return
        reader = pa.ipc.open_stream(fh)
        cols = [c for c in columns if c in reader.schema.names]
        for batch in reader:
            yield batch.select(cols)
