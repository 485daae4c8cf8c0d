"""The one rule for temporary files, in the one helper every atomic write uses (docs/datapipe.md,
"Temporary files and interrupted runs").

A file or folder is written under `.tmp-<final name>`, in the folder of its final name, then fsynced and
renamed to its final name; nothing reads a `.tmp-*` name. The temporary name is deterministic, so:
- the rerun of an interrupted write (a redone build task, the next save of a checkpoint step, a rerun
  export) meets its predecessor's leftover under the same name: it removes it, says so ("removed 1 stale
  temporary file from an interrupted run: PATH") and writes again;
- the run that owns an output folder sweeps it for `.tmp-*` leftovers when it starts (`sweep`: the build
  its output and work folders, training its run and checkpoint folders, `train eval` its results folder),
  so a leftover whose write is never redone is removed and counted too.
On an object store an object appears only when its upload completes: `atomic_file` aborts the multipart
upload of a write that fails or is interrupted, and `sweep` aborts the unfinished multipart uploads an
interrupted (killed) run left under the prefix it owns, so none is left to bill.
One writer per final name and one run per output folder at a time are assumed (a concurrent writer would
see its temporary file taken away and fail with an error naming it, never publish a mix).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from typing import BinaryIO

from storage import fs

log = logging.getLogger("storage.atomic")
TMP_PREFIX = ".tmp-"


def tmp_path(final: str) -> str:
    """The temporary name of `final` while it is written: `.tmp-<name>` in the same folder."""
    head, tail = os.path.split(final.rstrip("/"))
    return os.path.join(head, TMP_PREFIX + tail)


def is_tmp(name: str) -> bool:
    return os.path.basename(name.rstrip("/")).startswith(TMP_PREFIX)


def stale_message(files: list[str], folders: list[str], root: str | None = None) -> str:
    """'removed 1 stale temporary file from an interrupted run: PATH', or for several '... 2 stale temporary
    files and 1 stale temporary folder ... under ROOT: NAME, NAME, NAME'."""
    parts = [f"{len(p)} stale temporary {what}{'s' if len(p) != 1 else ''}"
             for p, what in ((files, "file"), (folders, "folder")) if p]
    paths = files + folders
    names = [os.path.relpath(p, root) for p in paths[:10]] if root else paths[:10]
    more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
    where = f": {paths[0]}" if len(paths) == 1 or root is None else f" under {root}: {', '.join(names)}{more}"
    return f"removed {' and '.join(parts)} from an interrupted run{where}"


def _remove(path: str) -> bool:
    """Remove a file or folder; True if it was a folder."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
        return True
    os.unlink(path)
    return False


def clear_stale(tmp: str) -> bool:
    """Remove an interrupted run's leftover at temporary name `tmp`, reporting it; True if there was one."""
    if not os.path.lexists(tmp):
        return False
    folder = _remove(tmp)
    log.warning(stale_message([] if folder else [tmp], [tmp] if folder else []))
    return True


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str, final: str) -> None:
    """fsync the finished temporary file `tmp` and rename it to `final` (atomic on POSIX), then its folder."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


class AtomicFile:
    """A file being written for `url`: `.file` takes the bytes; `commit()` publishes them under the final
    name, `abort()` (any failure) leaves nothing. Local: `.tmp-<name>` renamed; object store: one upload,
    completed by `commit()` and aborted by `abort()` (fsspec would otherwise complete a partial one).
    `shared=True` is for the one kind of file several processes may write at once with the same bytes (a
    multi-node launch's config.yaml): its temporary name gets `.<host>-<pid>` so the writers never meet;
    the owner's `sweep` still finds a leftover."""

    def __init__(self, url: str, shared: bool = False):
        self.url, self.local, self.done = url, fs.is_local(url), False
        if self.local:
            self.path = os.path.abspath(fs.local_path(url))
            self.tmp = tmp_path(self.path) + (f".{socket.gethostname()}-{os.getpid()}" if shared else "")
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            try:
                fd = os.open(self.tmp, flags, 0o644)
            except FileExistsError:
                clear_stale(self.tmp)
                fd = os.open(self.tmp, flags, 0o644)
            self.file: BinaryIO = os.fdopen(fd, "wb")
        else:
            fsys, path = fs.get_fs(url)
            self.file = fsys.open(path, "wb")

    def commit(self) -> None:
        if self.local:
            self.file.flush()
            os.fsync(self.file.fileno())
            mine = os.fstat(self.file.fileno())
            self.file.close()
            st = os.stat(self.tmp)  # FileNotFoundError if another process removed it
            if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
                raise RuntimeError(f"{self.tmp}: another process replaced this temporary file while it was "
                                   "written (two writers of one file at once)")
            os.replace(self.tmp, self.path)
            fsync_dir(os.path.dirname(self.path))
        else:
            self.file.close()  # completes the upload
        self.done = True

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        if self.local:
            self.file.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
        else:
            with contextlib.suppress(Exception):
                self.file.discard()  # s3fs: aborts the multipart upload
            with contextlib.suppress(Exception):
                self.file.closed = True  # fsspec's close() would complete the upload


@contextlib.contextmanager
def atomic_file(url: str, shared: bool = False) -> Iterator[BinaryIO]:
    """`with atomic_file(url) as f: f.write(...)`: `url` appears, complete, only when the block ends
    without an exception (`shared`: see AtomicFile)."""
    af = AtomicFile(url, shared)
    try:
        yield af.file
    except BaseException:
        af.abort()
        raise
    try:
        af.commit()
    except BaseException:
        af.abort()
        raise


def write_bytes(url: str, data: bytes, shared: bool = False) -> None:
    """Write `data` so that `url` either does not exist or holds all of it (local: `.tmp-` + fsync +
    rename; object store: one upload, a multipart one aborted by s3fs if it fails, retried)."""
    if fs.is_local(url):
        with atomic_file(url, shared) as f:
            f.write(data)
        return
    fsys, path = fs.get_fs(url)
    fs.with_retries(lambda: fsys.pipe_file(path, data), f"write {url}")


def save_figure(fig, path: str, **savefig_kwargs) -> None:
    """matplotlib's `fig.savefig(path)` under the same rule (the format from the file name)."""
    with atomic_file(path) as f:
        fig.savefig(f, format=os.path.splitext(path)[1][1:] or "png", **savefig_kwargs)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


@contextlib.contextmanager
def atomic_dir(final: str) -> Iterator[str]:
    """`with atomic_dir(out) as tmp:` write the folder's files under `tmp` (`.tmp-<name>` beside `out`);
    at the end they are fsynced and published: the folder renamed to `out` when `out` is absent or
    empty, else each file renamed into `out` (replacing the one it had), subfolders alike. An exception
    removes `tmp`."""
    final = os.path.abspath(final)
    tmp = tmp_path(final)
    clear_stale(tmp)
    os.makedirs(tmp)
    try:
        yield tmp
        _fsync_tree(tmp)
        if not os.path.isdir(final) or not os.listdir(final):
            os.replace(tmp, final)  # rename(2) replaces an empty folder
        else:
            for dirpath, _, files in os.walk(tmp):
                dest = os.path.join(final, os.path.relpath(dirpath, tmp))
                os.makedirs(dest, exist_ok=True)
                for name in files:
                    os.replace(os.path.join(dirpath, name), os.path.join(dest, name))
                fsync_dir(dest)
            shutil.rmtree(tmp)
        fsync_dir(os.path.dirname(final))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sweep(url: str) -> int:
    """Remove every `.tmp-*` file or folder under `url` (a local folder, recursively) left by an interrupted
    run, and on S3 abort the unfinished multipart uploads under the prefix; log the count ("removed 2 stale
    temporary files from an interrupted run under ROOT: NAME, NAME"). Call it when the run owning `url` starts,
    before it writes there. Returns how many were removed or aborted."""
    if not fs.is_local(url):
        return abort_uploads(url)
    root = os.path.abspath(fs.local_path(url))
    files: list[str] = []
    folders: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [n for n in dirnames if n.startswith(TMP_PREFIX)]:
            dirnames.remove(name)  # not descended into: removed whole
            folders.append(os.path.join(dirpath, name))
        files += [os.path.join(dirpath, n) for n in filenames if n.startswith(TMP_PREFIX)]
    for p in files + folders:
        _remove(p)
    if files or folders:
        log.warning(stale_message(sorted(files), sorted(folders), root))
    return len(files) + len(folders)


def abort_uploads(url: str, fsys=None) -> int:
    """Abort the unfinished multipart uploads under the S3 prefix `url` (an interrupted run's; other object
    stores: nothing to do) and log how many; `fsys`: the filesystem to use (default: fsspec's for `url`).
    Returns the count."""
    if fsys is None:
        fsys, path = fs.get_fs(url)
    else:
        path = fsys._strip_protocol(url)
    if not hasattr(fsys, "call_s3"):
        return 0
    bucket, key, _ = fsys.split_path(path)
    prefix = key.rstrip("/") + "/" if key else ""
    n, marker = 0, {}
    while True:
        page = fsys.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
        for up in page.get("Uploads", []):
            fsys.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
            n += 1
        if not page.get("IsTruncated"):
            break
        marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}
    if n:
        log.warning(f"aborted {n} unfinished multipart upload{'s' if n != 1 else ''} from an interrupted run "
                    f"under {url}")
    return n
