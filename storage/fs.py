"""Filesystem access for local paths and any fsspec URL: reads (whole, ranged) with retries. Atomic writes
follow the temporary-file rule in `storage.atomic`."""
from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Callable, TypeVar

import fsspec
from fsspec.core import url_to_fs

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def get_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a local path or URL."""
    return url_to_fs(url)


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


def with_retries(fn: Callable[[], T], what: str, attempts: int = 4, backoff_s: float = 0.2) -> T:
    """Call fn, retrying transient I/O errors with exponential backoff; the last error propagates."""
    for attempt in range(attempts):
        try:
            return fn()
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except OSError as e:
            if attempt == attempts - 1:
                raise
            delay = backoff_s * (2 ** attempt)
            log.warning("%s failed (%s); retry %d/%d in %.1fs", what, e, attempt + 1, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def file_sha256(path: str) -> str:
    """The sha256 hex digest of a local file, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_bytes(url: str) -> bytes:
    if is_local(url):
        with open(local_path(url), "rb") as f:
            return f.read()
    fs, path = get_fs(url)
    return with_retries(lambda: fs.cat_file(path), f"read {url}")


def read_range(url: str, offset: int, size: int) -> bytes:
    """Exactly `size` bytes at `offset` (pread locally, ranged GET remotely); short reads are errors."""
    if is_local(url):
        fd = os.open(local_path(url), os.O_RDONLY)
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
    else:
        fs, path = get_fs(url)
        data = with_retries(lambda: fs.cat_file(path, start=offset, end=offset + size),
                            f"read {url} [{offset}:{offset + size}]")
    if len(data) != size:
        raise EOFError(f"{url}: wanted {size} bytes at offset {offset}, file has only {len(data)} there "
                       "(truncated?)")
    return data


def exists(url: str) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = get_fs(url)
    return fs.exists(path)
