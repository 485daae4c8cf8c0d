"""On-disk layout of a checkpoint folder: names, manifest with checksums, atomic commit, verify, `latest`.

    <dir>/step_00000200/            a committed checkpoint (renamed from a temporary name when complete)
        manifest.json               written last: step, kind, base, layout, {file: size + xxh3_128}, bytes
        metadata.json, common.pt, tensors/rankN.bin|.json   megatron dist_checkpointing; raw tensor pieces
        delta/rank00000.bin|.json   incremental checkpoints: XOR deltas (byte planes) against the base's tensors
        train_state.pt, rng/rank00000.pt
    <dir>/.tmp-step_00000200/       being written (storage.atomic's rule: never read; an interrupted one is
                                    removed and counted when the run starts, or by the next save of that step)
    <dir>/latest                    name of the newest committed checkpoint; moved after the rename

Everything here works on any fsspec filesystem, so the same verify serves local and offloaded copies.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import fsspec
import xxhash

from storage import atomic

from train.checkpoint.errors import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "smoltrain-ckpt/1"
_NAME_RE = re.compile(r"^step_(\d{8,})$")
_CHUNK = 8 << 20


def ckpt_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def tmp_dir_for(root: str, step: int) -> str:
    """Where the save of `step` is written before its commit renames it (`.tmp-step_N`)."""
    return atomic.tmp_path(os.path.join(root, ckpt_name(step)))


@dataclass
class CkptInfo:
    name: str
    step: int
    kind: str
    base: str | None
    manifest: dict = field(repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.manifest["files"].values())


def checksum_file(fs: fsspec.AbstractFileSystem, path: str, fsync: bool = False) -> tuple[int, str]:
    """(size, XXH3-128 hex) of a file; with fsync (local only) the file's data is also flushed to disk.
    XXH3 is a non-cryptographic checksum that runs at memory speed, far ahead of sha256."""
    h, n = xxhash.xxh3_128(), 0
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, _CHUNK):
                h.update(chunk)
                n += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        return n, h.hexdigest()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def _local_files(root: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def _fsync_file(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def commit(tmp: str, root: str, step: int, kind: str, base: str | None, info: dict,
           hashed: dict | None = None) -> dict:
    """Checksum + fsync every file of `tmp`, write its manifest, rename it to its final name, move `latest`.

    `info` adds fields to the manifest (layout, bytes written, model metadata, ...). `hashed` maps relative
    paths to [size, xxh3_128] computed while the writer wrote them: those files are only fsynced (their
    size checked), not read back. Returns the manifest.
    """
    local = fsspec.filesystem("file")
    rels = _local_files(tmp)
    hashed = hashed or {}

    def one(rel: str) -> tuple[int, str]:
        path = os.path.join(tmp, rel)
        if rel in hashed:
            size, digest = hashed[rel]
            if _fsync_file(path) != size:
                raise CheckpointError(f"{path}: size changed after it was written")
            return size, digest
        return checksum_file(local, path, fsync=True)
    # fsync, os.read and xxhash release the GIL: files are done in parallel (one per rank and bucket).
    with ThreadPoolExecutor(max(1, min(8, len(rels), os.cpu_count() or 1))) as pool:
        sums = list(pool.map(one, rels))
    files = {rel: {"size": size, "xxh3_128": digest} for rel, (size, digest) in zip(rels, sums)}
    for dirpath, _, _ in os.walk(tmp):
        atomic.fsync_dir(dirpath)
    manifest = {"format": FORMAT, "name": ckpt_name(step), "step": step, "kind": kind, "base": base,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **info, "files": files}
    mpath = os.path.join(tmp, MANIFEST)
    with open(mpath, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    final = os.path.join(root, ckpt_name(step))
    if os.path.exists(final):
        # A checkpoint of the same step from an earlier (resumed) attempt: replace it.
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic.fsync_dir(root)
    write_latest(root, ckpt_name(step))
    return manifest


def write_latest(root: str, name: str) -> None:
    atomic.write_bytes(os.path.join(root, LATEST), (name + "\n").encode())


def read_latest(fs: fsspec.AbstractFileSystem, root: str) -> str | None:
    try:
        with fs.open(f"{root.rstrip('/')}/{LATEST}", "r") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def read_manifest(fs: fsspec.AbstractFileSystem, ckpt_path: str) -> dict:
    path = f"{ckpt_path.rstrip('/')}/{MANIFEST}"
    try:
        with fs.open(path, "r") as f:
            m = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_path}: {MANIFEST} is missing (incomplete checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{ckpt_path}: {MANIFEST} is not valid JSON ({e})") from None
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt_path}: {MANIFEST} has format {m.get('format')!r}, expected {FORMAT}")
    return m


def list_checkpoints(fs: fsspec.AbstractFileSystem, root: str) -> list[CkptInfo]:
    """Committed checkpoints under `root` (oldest first); folders without a readable manifest are skipped
    here and reported by `verify`."""
    out = []
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return out
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if step_of(name) is None:
            continue
        try:
            m = read_manifest(fs, f"{root.rstrip('/')}/{name}")
        except CheckpointError:
            continue
        out.append(CkptInfo(name, m["step"], m["kind"], m.get("base"), m))
    return sorted(out, key=lambda c: c.step)


def checkpoint_names(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """All checkpoint folder names under root, committed or broken (oldest first)."""
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
    return sorted((n for n in names if step_of(n) is not None), key=step_of)


def verify(fs: fsspec.AbstractFileSystem, root: str, name: str, checksums: bool = True,
           chain: bool = True) -> list[str]:
    """Problems found in checkpoint `name` (empty list: it verifies). With `chain`, its base is checked too.

    Checks: manifest readable; each listed file present with its size and (checksums) its xxh3_128; no
    unlisted data files; its pickles (*.pt, torch_dist's .metadata) load without running code from them
    (`safe_load`: a checkpoint from someone else may hold a pickle that would).
    """
    from train.checkpoint import safe_load

    path = f"{root.rstrip('/')}/{name}"
    try:
        m = read_manifest(fs, path)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    try:
        present = {p[len(path) + 1:]: d for p, d in fs.find(path, detail=True).items()}
    except FileNotFoundError:
        return [f"{path}: folder is missing"]
    for rel, want in m["files"].items():
        got = present.get(rel)
        if got is None:
            problems.append(f"{path}/{rel}: file is missing")
            continue
        if int(got["size"]) != want["size"]:
            problems.append(f"{path}/{rel}: size {got['size']} != {want['size']} in manifest (truncated?)")
            continue
        if checksums:
            _, digest = checksum_file(fs, f"{path}/{rel}")
            if digest != want["xxh3_128"]:
                problems.append(f"{path}/{rel}: checksum mismatch (corrupted)")
                continue
        if rel.endswith(".pt") or rel.rsplit("/", 1)[-1] == ".metadata":
            problem = safe_load.check_file(rel, fs.cat_file(f"{path}/{rel}"), path)
            if problem:
                problems.append(problem)
    extra = sorted(set(present) - set(m["files"]) - {MANIFEST})
    problems += [f"{path}/{rel}: file not in manifest" for rel in extra]
    if chain and m.get("base"):
        base_problems = verify(fs, root, m["base"], checksums=checksums, chain=False)
        problems += [f"{path}: base {m['base']} does not verify: {p}" for p in base_problems]
    return problems


def find_checkpoints(path: str, every: bool) -> list[str]:
    """A checkpoint folder itself, or a run dir's (or checkpoints folder's) checkpoints, newest only
    unless `every`. ConfigError when there is none."""
    from pathlib import Path

    from storage.config import ConfigError

    p = Path(path).resolve()
    if (p / MANIFEST).is_file():
        return [str(p)]
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    names = [c.name for c in list_checkpoints(fsspec.filesystem("file"), str(root))]
    if not names:
        raise ConfigError(f"{path}: no checkpoints (give a step_… folder or a run directory)")
    return [str(root / n) for n in (names if every else names[-1:])]
