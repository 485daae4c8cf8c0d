"""Shard format v1: tar files of LZ4-compressed token blocks, their index, and safe readers.

This module is the format and its readers; `storage.shard_writer` writes shards. A shard is a plain
ustar tar. Each sample is a block of whole documents, stored as two members:
`KEY.tokens.lz4` (one LZ4 frame of a little-endian uint16/uint32 array; every document ends with EOS)
and `KEY.json` (document ids, token offsets, source). `SHARD.tar.idx` lists member data offsets and
sizes in DALI's webdataset index format (v1.2; DALI reads it as is), so one block can be range-read
without a scan.
"""
from __future__ import annotations

import hashlib
import io
import mmap
import os
import re
import tarfile
import threading
import weakref
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import lz4.frame
import numpy as np
import orjson

from storage import codec, fs

FORMAT_VERSION = 1
TOKENS_EXT = "tokens.lz4"
META_EXT = "json"
INDEX_SUFFIX = ".idx"
TAR_BLOCK = 512
# 1 MiB frame blocks decode fastest here; integrity comes from an xxh3-64 of the frame in the block's
# JSON (about 5x cheaper than LZ4's own xxh32 content checksum, which would halve decode speed).
_LZ4_BLOCK_SIZE = lz4.frame.BLOCKSIZE_MAX1MB


class ShardError(ValueError):
    """A shard that cannot be trusted: names the shard, the member and the byte offset."""

    def __init__(self, shard: str, msg: str, member: str | None = None, offset: int | None = None):
        where = shard
        if member is not None:
            where += f", member {member}"
        if offset is not None:
            where += f", offset {offset}"
        super().__init__(f"{where}: {msg}")
        self.shard, self.member, self.offset, self.msg = shard, member, offset, msg

    def __reduce__(self):  # pickles with its fields (loader worker processes send it to the consumer)
        return type(self), (self.shard, self.msg, self.member, self.offset)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def parse_dtype(name: str) -> np.dtype:
    if name not in ("uint16", "uint32"):
        raise ValueError(f"token dtype must be uint16 or uint32, got {name!r}")
    return np.dtype("<u2") if name == "uint16" else np.dtype("<u4")


@dataclass
class Block:
    """One decoded sample: whole documents' tokens plus their ids and offsets (len(doc_ids) + 1)."""
    key: str
    tokens: np.ndarray
    doc_ids: list[str]
    offsets: list[int]
    source: str


@dataclass(frozen=True)
class IndexEntry:
    """Where one block's two members sit in its shard (header offsets, data sizes)."""
    key: str
    tokens_offset: int
    tokens_size: int
    meta_offset: int
    meta_size: int

    @property
    def span(self) -> tuple[int, int]:
        """(start, length) of one range read covering both members."""
        start = min(self.tokens_offset, self.meta_offset)
        end = max(self.tokens_offset + TAR_BLOCK + self.tokens_size, self.meta_offset + TAR_BLOCK + self.meta_size)
        return start, end - start


def encode_tokens(tokens: np.ndarray, dtype: np.dtype, compression_level: int = 0) -> bytes:
    arr = np.ascontiguousarray(tokens)
    if arr.dtype != dtype:
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(dtype).max):
            raise ValueError(f"token ids out of range for {dtype.name}")
        arr = arr.astype(dtype)
    return lz4.frame.compress(arr.tobytes(), compression_level=compression_level, block_size=_LZ4_BLOCK_SIZE,
                              content_checksum=False)


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
        if t_off < TAR_BLOCK or m_off < TAR_BLOCK or t_off % TAR_BLOCK or m_off % TAR_BLOCK:
            raise ShardError(shard + INDEX_SUFFIX, f"line {lineno}: member data offsets must be positive multiples "
                             f"of {TAR_BLOCK}")
        entries.append(IndexEntry(key, t_off - TAR_BLOCK, t_size, m_off - TAR_BLOCK, m_size))
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


_HEAD = re.compile(rb'"dtype":"(uint16|uint32)","n_tokens":(\d+),"xxh3_64":"([0-9a-f]{16})"')


def _checked_tokens(shard: str, key: str, payload, dtype: np.dtype, n: int, digest: str, offset: int, verify: bool,
                    out: np.ndarray | None) -> np.ndarray:
    member = f"{key}.{TOKENS_EXT}"
    if verify and codec.xxh3_64(payload) != int(digest, 16):
        raise ShardError(shard, f"checksum mismatch: xxh3_64 of the LZ4 frame is not {digest} (corrupt block)",
                         member, offset)
    if out is None:
        if n * dtype.itemsize > 255 * len(payload) + 64:  # beyond LZ4's best ratio: the count is corrupt
            raise ShardError(shard, f"metadata says {n} tokens, more than a {len(payload)}-byte LZ4 frame can hold",
                             f"{key}.{META_EXT}")
        out = np.empty(n, dtype=dtype)
    elif out.dtype != dtype or len(out) < n:
        raise ShardError(shard, f"block holds {n} {dtype.name} tokens; expected at most {len(out)} {out.dtype.name} "
                         "(the dataset's dtype and largest block)", f"{key}.{META_EXT}")
    try:
        size = codec.decompress_into(payload, out)
    except codec.FrameError as e:
        raise ShardError(shard, f"LZ4 frame does not decode ({e})", member, offset) from None
    if size != n * dtype.itemsize:
        raise ShardError(shard, f"decoded {size} bytes, metadata says {n} {dtype.name} tokens", member, offset)
    return out[:n]


def _parse_meta(shard: str, key: str, meta_bytes) -> tuple[dict, np.dtype, int, str]:
    """(the JSON member, token dtype, token count, xxh3_64 hex digest), all checked."""
    try:
        meta = orjson.loads(meta_bytes)
        dtype = parse_dtype(meta["dtype"])
        doc_ids, offsets, n = meta["doc_ids"], meta["offsets"], int(meta["n_tokens"])
        digest = meta["xxh3_64"]
        int(digest, 16)
    except (ValueError, KeyError, TypeError) as e:  # orjson.JSONDecodeError is a ValueError
        raise ShardError(shard, f"bad block metadata: {e}", f"{key}.{META_EXT}") from None
    if len(offsets) != len(doc_ids) + 1 or (offsets and (offsets[0] != 0 or offsets[-1] != n)):
        raise ShardError(shard, "document offsets do not match the token count", f"{key}.{META_EXT}")
    return meta, dtype, n, digest


def decode_block(shard: str, key: str, payload: bytes | memoryview, meta_bytes: bytes | memoryview, offset: int,
                 verify: bool = True) -> Block:
    """Check and decode one block; `verify=False` skips the xxh3 check (the LZ4 decoder still runs)."""
    meta, dtype, n, digest = _parse_meta(shard, key, meta_bytes)
    tokens = _checked_tokens(shard, key, payload, dtype, n, digest, offset, verify, None)
    return Block(key, tokens, meta["doc_ids"], meta["offsets"], meta.get("source", ""))


def decode_tokens(shard: str, key: str, payload: bytes | memoryview, meta_bytes: bytes | memoryview, offset: int,
                  out: np.ndarray) -> np.ndarray:
    """The streaming loader's path: check and decode one block's tokens into `out` (C-contiguous, of the
    block's dtype, long enough); returns the view of `out` that holds them.

    Only dtype, n_tokens and xxh3_64 are needed. The writer puts them first in the JSON member, so they
    come from its first bytes without parsing the document lists (which cost about as much as the
    checksum); JSON in another layout takes the full parse."""
    head = _HEAD.search(bytes(meta_bytes[:256]))
    if head is None:
        _, dtype, n, digest = _parse_meta(shard, key, meta_bytes)
    else:
        dtype, n, digest = parse_dtype(head[1].decode()), int(head[2]), head[3].decode()
    return _checked_tokens(shard, key, payload, dtype, n, digest, offset, True, out)


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
    extra = set(members) - {TOKENS_EXT, META_EXT}
    if extra:
        raise ShardError(url, f"sample {key} has unexpected members {sorted(extra)}", key, offset)
    return decode_block(url, key, members[TOKENS_EXT], members[META_EXT], offset)


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
        e = self.index[k]
        start, length = e.span
        try:
            buf = self._read(start, length, zero_copy)
        except EOFError as err:
            raise ShardError(self.url, f"block {k} lies beyond the end of the file ({err})",
                             f"{e.key}.{TOKENS_EXT}", start) from None
        return (self._member(buf, start, e.tokens_offset, e.tokens_size, f"{e.key}.{TOKENS_EXT}"),
                self._member(buf, start, e.meta_offset, e.meta_size, f"{e.key}.{META_EXT}"))

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
        payload, meta = self.read_raw(k, zero_copy=True)
        block = decode_block(self.url, self.index[k].key, payload, meta, self.index[k].tokens_offset, verify)
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
        out.append(IndexEntry(key, *comps[TOKENS_EXT], *comps[META_EXT]))
    return out
