"""Offload: copy each committed checkpoint to an fsspec URL in the background, verify the remote copy,
apply retention there, and only then delete local copies beyond `keep_local`; pull back when no local
checkpoint verifies.

Remote layout mirrors the local one: URL/step_XXXXXXXX/<files>, the manifest uploaded last (a remote
checkpoint without a manifest is incomplete), URL/latest moved after the remote copy verifies. An
interrupted run's leftovers under URL (unfinished multipart uploads, folders without a manifest) are
removed and counted when the next run's offloader starts (storage.atomic's rule).
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import threading

import fsspec

from storage import atomic
from storage.fs import get_fs
from train.checkpoint import layout, retention
from train.checkpoint.incremental import retire

log = logging.getLogger("train.checkpoint")
_CLEAN_UP = ""  # the offload thread's first job (a checkpoint name is never empty)


class Offloader:
    """One background thread on rank 0; `submit(name)` after each commit; `wait()` drains the queue."""

    def __init__(self, url: str, local_root: str, keep_local: int, keep_last: int, full_every: int,
                 keep_full_every: int):
        self.url, self.local_root, self.keep_local = url.rstrip("/"), local_root, keep_local
        self.policy = (keep_last, full_every, keep_full_every)
        self.fs, self.rroot = get_fs(self.url)
        self.local = fsspec.filesystem("file")
        self.verified: set[str] = set()
        self.errors: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._loop, name="ckpt-offload", daemon=True)
        self._q.put(_CLEAN_UP)  # first: what an interrupted run left unfinished remotely
        self._t.start()

    def submit(self, name: str) -> None:
        self._q.put(name)

    def wait(self) -> None:
        self._q.join()

    def close(self) -> None:
        self.wait()
        self._q.put(None)
        self._t.join()

    def _loop(self) -> None:
        while True:
            name = self._q.get()
            try:
                if name is None:
                    return
                if name == _CLEAN_UP:
                    self.clean_up()
                    continue
                self.upload(name)
                self.prune()
            except Exception as e:  # noqa: BLE001 - reported; local copies stay
                if name == _CLEAN_UP:  # not a checkpoint's failure; uploads report their own
                    log.warning("clean-up of %s failed: %r", self.url, e)
                    continue
                msg = f"offload of checkpoint {name} to {self.url} failed: {e!r}"
                log.error(msg)
                self.errors.append(msg)
            finally:
                self._q.task_done()

    def clean_up(self) -> None:
        """Abort the multipart uploads an interrupted (killed) run left under the URL, and remove its
        remote checkpoint folders that never got their manifest (uploaded last), counting them."""
        atomic.abort_uploads(self.url)
        self.fs.invalidate_cache()
        names = [n for n in layout.checkpoint_names(self.fs, self.rroot)
                 if not self.fs.exists(self._rpath(n, layout.MANIFEST))]
        for n in names:
            self.fs.rm(self._rpath(n), recursive=True)
        if names:
            log.warning("removed %d incomplete remote checkpoint upload%s from an interrupted run under %s: %s",
                        len(names), "s" if len(names) != 1 else "", self.url, ", ".join(names))

    def _rpath(self, *parts: str) -> str:
        return "/".join([self.rroot.rstrip("/"), *parts])

    def upload(self, name: str) -> None:
        src = os.path.join(self.local_root, name)
        m = layout.read_manifest(self.local, src)
        for rel in sorted(m["files"]):
            self.fs.put_file(os.path.join(src, rel), self._rpath(name, rel))
        self.fs.put_file(os.path.join(src, layout.MANIFEST), self._rpath(name, layout.MANIFEST))
        self.fs.invalidate_cache()
        problems = layout.verify(self.fs, self.rroot, name, checksums=True, chain=False)
        if problems:
            raise layout.CheckpointError(f"remote copy of {name} does not verify: {'; '.join(problems[:3])}")
        self.verified.add(name)
        self.fs.pipe_file(self._rpath(layout.LATEST), (name + "\n").encode())
        log.info("checkpoint %s offloaded to %s/%s and verified", name, self.url, name)

    def remote_verified(self, name: str) -> bool:
        if name not in self.verified:
            self.fs.invalidate_cache()
            if not layout.verify(self.fs, self.rroot, name, checksums=True, chain=False):
                self.verified.add(name)
        return name in self.verified

    def prune(self) -> None:
        """Remote retention by policy; local copies beyond keep_local deleted once verified remotely."""
        self.fs.invalidate_cache()
        remote = layout.list_checkpoints(self.fs, self.rroot)
        for name in retention.to_delete(remote, *self.policy):
            self.fs.rm(self._rpath(name), recursive=True)
            self.verified.discard(name)
        local = layout.list_checkpoints(self.local, self.local_root)
        keep = retention.keep_set(local, self.keep_local, 0, 0)
        for c in local:
            if c.name not in keep and self.remote_verified(c.name):
                retire(self.local_root, c.name)
                log.info("local copy of checkpoint %s deleted (remote copy verified)", c.name)


def pull_newest(url: str, local_root: str, checksums: bool = True) -> str | None:
    """Download the newest remote checkpoint that verifies (with its base) into local_root; its name."""
    fs, rroot = get_fs(url.rstrip("/"))
    local = fsspec.filesystem("file")
    fs.invalidate_cache()
    for name in reversed(layout.checkpoint_names(fs, rroot)):
        problems = layout.verify(fs, rroot, name, checksums=checksums, chain=True)
        if problems:
            log.warning("skipping remote checkpoint %s/%s: %s", url, name, "; ".join(problems[:3]))
            continue
        m = layout.read_manifest(fs, f"{rroot}/{name}")
        for n in [m["base"], name] if m.get("base") else [name]:
            if not layout.verify(local, local_root, n, checksums=checksums, chain=False):
                continue
            tmp = layout.tmp_dir_for(local_root, layout.step_of(n))
            atomic.clear_stale(tmp)
            fs.get(f"{rroot}/{n}/", tmp + "/", recursive=True)
            shutil.rmtree(os.path.join(local_root, n), ignore_errors=True)
            os.replace(tmp, os.path.join(local_root, n))
        log.info("pulled checkpoint %s from %s", name, url)
        return name
    return None
