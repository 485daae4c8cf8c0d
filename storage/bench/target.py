"""Targets (local directory or fsspec URL), preflight checks before any I/O, and test-file cleanup.

Every test file lives in one scratch directory (or object prefix) per target, named
`.smoltrain-bench-HOST-PID-RANDOM`; `Scratch.remove()` deletes it (and aborts unfinished multipart uploads
under it) and runs from a `finally`, and SIGTERM is turned into KeyboardInterrupt so that Ctrl-C and `kill`
both leave nothing behind. A benchmark killed with SIGKILL cannot clean up: the next one on the same host
removes (and counts) the scratch of every benchmark of this host whose process is gone.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import socket
import uuid
from dataclasses import dataclass

from storage import atomic, fs
from storage.bench.units import fmt_size

log = logging.getLogger("storage.bench")
SCRATCH_PREFIX = ".smoltrain-bench-"
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


class BenchError(Exception):
    """Bad input or an environment the benchmark cannot run in; the message says what and where."""


@dataclass
class Target:
    url: str
    kind: str  # "local" or "object"
    fs_type: str
    mount: str

    @property
    def path(self) -> str:
        return fs.local_path(self.url)

    @property
    def volatile(self) -> bool:
        return self.fs_type in MEMORY_FS


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding `path`, from /proc/self/mountinfo."""
    real = os.path.realpath(path)
    best, fstype = "/", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, right.split()[0]
    except OSError:
        pass
    return best, fstype


def resolve(url: str) -> Target:
    if fs.is_local(url):
        path = os.path.abspath(fs.local_path(url))
        mnt, fstype = mount_of(path) if os.path.exists(path) else ("", "unknown")
        return Target(path, "local", fstype, mnt)
    protocol = url.split("://", 1)[0]
    return Target(url.rstrip("/"), "object", protocol, url.split("/", 3)[2] if url.count("/") >= 2 else url)


def preflight_local(t: Target, need_bytes: int) -> None:
    """Fail with a clear message, before any test I/O, if `t` cannot hold `need_bytes` of test files."""
    p = t.path
    if not os.path.exists(p):
        raise BenchError(f"{p}: path does not exist (create the directory first)")
    if not os.path.isdir(p):
        raise BenchError(f"{p}: not a directory (give the directory to benchmark)")
    st = os.statvfs(p)
    if st.f_flag & os.ST_RDONLY:
        raise BenchError(f"{p}: not writable: the filesystem is mounted read-only ({t.fs_type} at {t.mount})")
    if not os.access(p, os.W_OK | os.X_OK):
        raise BenchError(f"{p}: not writable: permission denied for this user")
    # root passes access(2) on a chmod-555 or immutable directory, so try creating an empty file too.
    probe = os.path.join(p, f"{SCRATCH_PREFIX}probe-{uuid.uuid4().hex[:8]}")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as e:
        why = {errno.EROFS: "read-only filesystem", errno.EPERM: "operation not permitted (immutable?)",
               errno.EACCES: "permission denied"}.get(e.errno, e.strerror)
        raise BenchError(f"{p}: not writable: cannot create a file there ({why})") from None
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise BenchError(f"{p}: too little free space: the test files need {fmt_size(need_bytes)}, "
                         f"{fmt_size(free)} free on {t.mount} ({t.fs_type}); lower --file-size / --checkpoint")


def _dead_owner(name: str, host: str) -> bool:
    """True for the scratch name of a benchmark of this host whose process no longer runs."""
    parts = name[len(SCRATCH_PREFIX):].rstrip("/").rsplit("-", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return False  # another host's, or not a scratch name
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


class Scratch:
    """The scratch directory (local) or prefix (object store) of one target; remove() is idempotent."""

    def __init__(self, t: Target, fsys=None):
        self.target, self.fsys = t, fsys
        name = f"{SCRATCH_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root = os.path.join(t.path, name) if t.kind == "local" else f"{t.url}/{name}"
        self.removed = False

    def create(self) -> None:
        """Register the scratch with its owner first, then call this, so an interrupt can never orphan it."""
        self.remove_stale()
        if self.target.kind == "local":
            os.mkdir(self.root, 0o700)

    def remove_stale(self) -> int:
        """Remove the scratch a benchmark of this host killed with SIGKILL left in the target; their count."""
        host, t = socket.gethostname(), self.target
        if t.kind == "local":
            stale = [os.path.join(t.path, n) for n in os.listdir(t.path)
                     if n.startswith(SCRATCH_PREFIX) and _dead_owner(n, host)]
            for p in stale:
                shutil.rmtree(p, ignore_errors=True)
        elif self.fsys is not None:
            base = t.url.split("://", 1)[1]
            try:
                entries = self.fsys.ls(base, detail=False)
            except FileNotFoundError:
                entries = []
            stale = [f"{t.url}/{e.rstrip('/').rsplit('/', 1)[-1]}" for e in entries
                     if e.rstrip("/").rsplit("/", 1)[-1].startswith(SCRATCH_PREFIX)
                     and _dead_owner(e.rstrip("/").rsplit("/", 1)[-1], host)]
            for url in stale:
                self.fsys.rm(url.split("://", 1)[1], recursive=True)
                atomic.abort_uploads(url, self.fsys)
        else:
            stale = []
        if stale:
            log.warning(atomic.stale_message([], stale, t.path if t.kind == "local" else t.url))
        return len(stale)

    def file(self, name: str) -> str:
        return f"{self.root}/{name}" if self.target.kind == "object" else os.path.join(self.root, name)

    def remove(self) -> None:
        if self.removed:
            return
        self.removed = True
        if self.target.kind == "local":
            shutil.rmtree(self.root, ignore_errors=True)
        elif self.fsys is not None:
            try:
                self.fsys.rm(self.root.split("://", 1)[1], recursive=True)
            except FileNotFoundError:
                pass
            atomic.abort_uploads(self.root, self.fsys)  # an interrupted upload's parts are billed until aborted


def sigterm_as_interrupt() -> None:
    """Make SIGTERM behave like Ctrl-C, so `finally` blocks remove the test files."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)
