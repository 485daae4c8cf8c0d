"""Shard formats v1 and v2: tar files of LZ4-compressed token blocks, their index, and safe readers.

This module is the format and its readers (the per-block codec lives in `storage.blocks`, re-exported
here); `storage.shard_writer` writes shards. A shard is a plain
ustar tar. Each sample is a block of whole documents, stored as two members:
`KEY.tokens.lz4` (one LZ4 frame of a little-endian uint16/uint32 array; pretraining documents end with
EOS) and `KEY.json` (document ids, token offsets, source). Format v2 adds, for blocks that carry a loss
mask (conversations), a third member `KEY.mask.lz4` (one LZ4 frame of a uint8 0/1 array, one per token)
after the JSON, whose xxh3-64 is the JSON's `mask_xxh3_64`; blocks without a mask stay v1, byte for
byte. `SHARD.tar.idx` lists member data offsets and sizes in DALI's webdataset index format (v1.2; DALI
reads it as is), so one block can be range-read without a scan.
"""
from __future__ import annotations

import functools
import hashlib
import io
import mmap
import os
import tarfile
import threading
import weakref
from dataclasses import dataclass
from typing import BinaryIO, Iterator


from storage import fs
from storage.blocks import (  # noqa: F401 - the block codec, re-exported: `storage.shards` is the format's API
    _LZ4_BLOCK_SIZE,
    FORMAT_VERSION,
    MASK_EXT,
    META_EXT,
    TOKENS_EXT,
    Block,
    ShardError,
    decode_block,
    decode_mask,
    decode_tokens,
    dtype_for_vocab,
    encode_tokens,
    parse_dtype,
)

INDEX_SUFFIX = ".idx"
TAR_BLOCK = 512


@dataclass(frozen=True)
class IndexEntry:
    """Where one block's members sit in its shard (header offsets, data sizes); mask_offset -1: no mask."""
    key: str
    tokens_offset: int
    tokens_size: int
    meta_offset: int
    meta_size: int
    mask_offset: int = -1
    mask_size: int = 0

    @functools.cached_property
    def span(self) -> tuple[int, int]:
        """(start, length) of one range read covering all members (computed once: every block read and
        every cache-cost estimate asks for it)."""
        start = min(self.tokens_offset, self.meta_offset)
        end = max(self.tokens_offset + self.tokens_size, self.meta_offset + self.meta_size)
        if self.mask_offset >= 0:
            start, end = min(start, self.mask_offset), max(end, self.mask_offset + self.mask_size)
        return start, end + TAR_BLOCK - start


def parse_index(text: str, shard: str) -> list[IndexEntry]:
    lines = text.splitlines()
    if not lines or not lines[0].startswith("v1.2 "):
        raise ShardError(shard + INDEX_SUFFIX, "not a v1.2 webdataset index")
    entries = []
    for lineno, line in enumerate(lines[1:], start=2):
        parts = line.split()
        comps: dict[str, tuple[int, int, str]] = {}
        for i in range(0, len(parts) - 3, 4):
            comps[parts[i]] = (int(parts[i + 1]), int(parts[i + 2]), parts[i + 3])
        if TOKENS_EXT not in comps or META_EXT not in comps:
            raise ShardError(shard + INDEX_SUFFIX, f"line {lineno}: sample lacks a {TOKENS_EXT} or {META_EXT} member")
        key = comps[TOKENS_EXT][2][: -len(TOKENS_EXT) - 1]
        (t_off, t_size, _), (m_off, m_size, _) = comps[TOKENS_EXT], comps[META_EXT]
        k_off, k_size, _ = comps.get(MASK_EXT, (TAR_BLOCK - 1, 0, ""))
        if any(o < TAR_BLOCK or o % TAR_BLOCK for o in (t_off, m_off, *((k_off,) if MASK_EXT in comps else ()))):
            raise ShardError(shard + INDEX_SUFFIX, f"line {lineno}: member data offsets must be positive multiples "
                             f"of {TAR_BLOCK}")
        entries.append(IndexEntry(key, t_off - TAR_BLOCK, t_size, m_off - TAR_BLOCK, m_size, k_off - TAR_BLOCK, k_size))
    if int(lines[0].split()[1]) != len(entries):
        raise ShardError(shard + INDEX_SUFFIX, f"header says {lines[0].split()[1]} samples, found {len(entries)}")
    return entries


def check_member(shard: str, ti: tarfile.TarInfo, offset: int) -> None:
    """Reject members a safe reader must never follow or create."""
    name = ti.name
    if not ti.isreg():
        kind = {tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hard link", tarfile.CHRTYPE: "character device",
                tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "fifo", tarfile.DIRTYPE: "directory"}.get(
            ti.type, f"type {ti.type!r}")
        raise ShardError(shard, f"unsafe member: {kind} (only regular files are allowed)", name, offset)
    if name.startswith("/") or os.path.isabs(name):
        raise ShardError(shard, "unsafe member: absolute path", name, offset)
    if ".." in name.replace("\\", "/").split("/"):
        raise ShardError(shard, "unsafe member: path traversal ('..')", name, offset)
    if "/" in name:
        raise ShardError(shard, "unsafe member: shard members must not contain directories", name, offset)


class _HashingReader(io.RawIOBase):
    def __init__(self, f: BinaryIO):
        self.f, self.sha, self.pos = f, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        n = self.f.readinto(b)  # type: ignore[attr-defined]
        if n:
            self.sha.update(memoryview(b)[:n])
            self.pos += n
        return n or 0


def _open_stream(url: str) -> BinaryIO:
    if fs.is_local(url):
        return open(fs.local_path(url), "rb")
    fsys, path = fs.get_fs(url)
    return fsys.open(path, "rb", block_size=8 << 20)


def iter_shard(url: str, expected_sha256: str | None = None) -> Iterator[Block]:
    """Read a whole shard front to back, checking every member, frame and (optionally) the sha256."""
    with _open_stream(url) as raw:
        hr = _HashingReader(raw)
        buffered = io.BufferedReader(hr, buffer_size=1 << 20)
        pending: dict[str, bytes] = {}
        pending_key, pending_off, n_members, data_end = None, 0, 0, 0
        try:
            tar = tarfile.open(fileobj=buffered, mode="r|")
            for ti in tar:
                n_members += 1
                check_member(url, ti, ti.offset)
                data_end = ti.offset_data + -(-ti.size // TAR_BLOCK) * TAR_BLOCK
                key, _, ext = ti.name.partition(".")
                if key != pending_key:
                    if pending_key is not None:
                        yield _complete(url, pending_key, pending, pending_off)
                    pending_key, pending, pending_off = key, {}, ti.offset
                f = tar.extractfile(ti)
                assert f is not None
                pending[ext] = f.read()
                if len(pending[ext]) != ti.size:
                    raise EOFError(f"member {ti.name} has {len(pending[ext])} of {ti.size} bytes")
        except (tarfile.TarError, EOFError) as e:
            raise ShardError(url, f"tar is truncated or malformed ({e})", offset=hr.pos) from None
        if pending_key is not None:
            yield _complete(url, pending_key, pending, pending_off)
        if n_members == 0:
            raise ShardError(url, "empty shard (no members)")
        tail = buffered.read()  # hash the end-of-archive padding as well
        # tarfile stops quietly at EOF on a header boundary; a complete archive ends in two zero blocks.
        if hr.pos % TAR_BLOCK or hr.pos < data_end + 2 * TAR_BLOCK or tail.strip(b"\0"):
            raise ShardError(url, f"tar is truncated: {hr.pos} bytes, no end-of-archive marker after the "
                             "last member", offset=hr.pos)
    if expected_sha256 is not None and hr.sha.hexdigest() != expected_sha256:
        raise ShardError(url, f"sha256 mismatch: manifest says {expected_sha256}, file has {hr.sha.hexdigest()}")


def _complete(url: str, key: str, members: dict[str, bytes], offset: int) -> Block:
    for ext in (TOKENS_EXT, META_EXT):
        if ext not in members:
            raise ShardError(url, f"sample {key} is missing its {ext} member", f"{key}.{ext}", offset)
    extra = set(members) - {TOKENS_EXT, META_EXT, MASK_EXT}
    if extra:
        raise ShardError(url, f"sample {key} has unexpected members {sorted(extra)}", key, offset)
    return decode_block(url, key, members[TOKENS_EXT], members[META_EXT], offset, mask_payload=members.get(MASK_EXT))


_RELEASE_BYTES = 256 << 20
_release_lock = threading.Lock()
_touched = 0
_mapped_readers: weakref.WeakSet = weakref.WeakSet()


class ShardReader:
    """Random access to one shard's blocks through its index: zero-copy views of a read-only memory map
    locally (as Megatron's memmap datasets do), ranged GETs remotely.

    The map is taken at first use and checked against the index, so a shard truncated before the run is
    a ShardError. Shards are immutable once published (atomic rename: a rewrite is a new inode, and the
    map keeps the old one); only truncating a mapped file in place would fault the process (SIGBUS)."""

    def __init__(self, url: str, index: list[IndexEntry] | None = None):
        self.url = url
        self._index = index
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()

    def _mapped(self) -> mmap.mmap | None:
        if self._map is None:
            with self._lock:
                if self._map is None:
                    with open(fs.local_path(self.url), "rb") as f:
                        size = os.fstat(f.fileno()).st_size
                        self._map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if size else None
                    with _release_lock:
                        _mapped_readers.add(self)
        return self._map

    def _read(self, offset: int, size: int, zero_copy: bool) -> bytes | memoryview:
        """Bytes [offset, offset+size): a view of the map when local and `zero_copy`, else a copy."""
        if not fs.is_local(self.url):
            return fs.read_range(self.url, offset, size)
        mm = self._mapped()
        have = len(mm) if mm is not None else 0
        if offset + size > have:
            raise EOFError(f"wanted {size} bytes at offset {offset}, the file has {have} bytes (truncated?)")
        view = memoryview(mm)[offset:offset + size]  # type: ignore[arg-type]
        return view if zero_copy else bytes(view)

    def release(self, k: int) -> None:
        """Count block k as consumed. Once readers have touched `_RELEASE_BYTES` of mapped data, every
        map drops its pages (they stay in the page cache), so RSS stays bounded over a long run; doing
        it in bulk keeps the syscalls and TLB flushes off the per-block path."""
        global _touched
        if self._map is None:
            return
        with _release_lock:
            _touched += self.index[k].span[1]
            if _touched < _RELEASE_BYTES:
                return
            _touched = 0
            readers = list(_mapped_readers)
        for r in readers:
            r._drop_pages()

    def _drop_pages(self) -> None:
        mm = self._map
        if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except ValueError:  # closed meanwhile
                pass

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views handed out are still alive; the map goes with the last of them
                pass
            self._map = None

    def __del__(self) -> None:
        self.close()

    @property
    def index(self) -> list[IndexEntry]:
        if self._index is None:
            idx_url = self.url + INDEX_SUFFIX
            try:
                text = fs.read_bytes(idx_url).decode()
            except FileNotFoundError:
                raise ShardError(self.url, f"index {idx_url} is missing (run `storage verify` to rebuild)") from None
            self._index = parse_index(text, self.url)
        return self._index

    def __len__(self) -> int:
        return len(self.index)

    def read_raw(self, k: int, zero_copy: bool = False) -> tuple[memoryview, memoryview]:
        """(LZ4 payload, JSON bytes) of block k, with both tar headers checked against the index.

        With `zero_copy` (local shards) the views point into the reader's memory map."""
        return self.read_members(k, zero_copy)[:2]  # type: ignore[return-value]

    def read_members(self, k: int, zero_copy: bool = False) -> tuple[memoryview, memoryview, memoryview | None]:
        """(tokens LZ4 payload, JSON bytes, mask LZ4 payload or None) of block k in one range read, every
        tar header checked against the index."""
        e = self.index[k]
        start, length = e.span
        try:
            buf = self._read(start, length, zero_copy)
        except EOFError as err:
            raise ShardError(self.url, f"block {k} lies beyond the end of the file ({err})",
                             f"{e.key}.{TOKENS_EXT}", start) from None
        mask = (self._member(buf, start, e.mask_offset, e.mask_size, f"{e.key}.{MASK_EXT}")
                if e.mask_offset >= 0 else None)
        return (self._member(buf, start, e.tokens_offset, e.tokens_size, f"{e.key}.{TOKENS_EXT}"),
                self._member(buf, start, e.meta_offset, e.meta_size, f"{e.key}.{META_EXT}"), mask)

    def _member(self, buf: bytes | memoryview, start: int, off: int, size: int, name: str) -> memoryview:
        """Check the member's ustar header against the index (name, regular file, size) and slice its data.

        Only the fields that matter are compared (a full tarfile parse costs more than the LZ4 decode of
        a small block); the data itself is covered by the block's xxh3 checksum."""
        rel = off - start
        header = bytes(buf[rel:rel + TAR_BLOCK])
        want = name.encode()
        got_name = header[:100].rstrip(b"\0")
        if got_name != want or header[156:157] not in (b"0", b"\0"):
            got = got_name.decode("utf-8", "replace")
            if got_name != want and got_name:
                raise ShardError(self.url, f"tar header says {got}, index says {name}; index and shard disagree",
                                 name, off)
            try:
                check_member(self.url, tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape"), off)
            except tarfile.HeaderError as e:
                raise ShardError(self.url, f"bad tar header ({e}); index and shard disagree", name, off) from None
            raise ShardError(self.url, f"tar header does not describe {name}", name, off)
        try:
            hsize = int(header[124:136].rstrip(b"\0 ") or b"0", 8)
        except ValueError:
            raise ShardError(self.url, "bad tar header size field", name, off) from None
        if hsize != size:
            raise ShardError(self.url, f"tar header says {hsize} bytes, index says {size}", name, off)
        return memoryview(buf)[rel + TAR_BLOCK: rel + TAR_BLOCK + size]

    def read_block(self, k: int, verify: bool = True) -> Block:
        payload, meta, mask = self.read_members(k, zero_copy=True)
        e = self.index[k]
        block = decode_block(self.url, e.key, payload, meta, e.tokens_offset, verify, mask, e.mask_offset)
        self.release(k)
        return block


def scan_index(url: str) -> list[IndexEntry]:
    """Rebuild a shard's index by scanning the tar (for shards whose .idx was lost)."""
    entries: dict[str, dict[str, tuple[int, int]]] = {}
    with _open_stream(url) as f:
        with tarfile.open(fileobj=f, mode="r|") as tar:
            for ti in tar:
                check_member(url, ti, ti.offset)
                key, _, ext = ti.name.partition(".")
                entries.setdefault(key, {})[ext] = (ti.offset, ti.size)
    out = []
    for key, comps in entries.items():
        if TOKENS_EXT not in comps or META_EXT not in comps:
            raise ShardError(url, f"sample {key} is missing a member", key)
        out.append(IndexEntry(key, *comps[TOKENS_EXT], *comps[META_EXT], *comps.get(MASK_EXT, (-1, 0))))
    return out
