"""Hot C calls made without holding the GIL: LZ4 frame decode into a caller's buffer, XXH3-64 of a
buffer (the loader's read path), and streaming XXH3-128 (checkpoint writes).

python-lz4 only returns new `bytes`, and decoding into fresh memory costs a page fault per 4 KiB, which
on a VM is a large share of a 512 KiB block's decode; the loader decodes into recycled buffers
instead. python-xxhash holds the GIL while it hashes, which stalls the loader's packing thread behind
the prefetch threads. Both packages ship and export the C libraries, so this module calls liblz4's
block decoder (parsing the frame, format spec v1.6.x, in Python) and XXH3_64bits through ctypes, which
releases the GIL for the call. Frames with a dictionary ID are refused; block and content checksums,
when present, are verified.
"""
from __future__ import annotations

import ctypes
import struct

import lz4.frame
import numpy as np
import xxhash

_xxh = ctypes.CDLL(xxhash._xxhash.__file__).XXH3_64bits
_xxh.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_xxh.restype = ctypes.c_uint64
_xlib = ctypes.CDLL(xxhash._xxhash.__file__)
_xlib.XXH3_createState.restype = ctypes.c_void_p
_xlib.XXH3_freeState.argtypes = [ctypes.c_void_p]
_xlib.XXH3_128bits_reset.argtypes = [ctypes.c_void_p]
_xlib.XXH3_128bits_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


_xlib.XXH3_128bits_digest.argtypes = [ctypes.c_void_p]
_xlib.XXH3_128bits_digest.restype = _Hash128
_lib = ctypes.CDLL(lz4.frame._frame.__file__)
_safe = _lib.LZ4_decompress_safe
_safe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
_safe.restype = ctypes.c_int
_with_dict = _lib.LZ4_decompress_safe_usingDict
_with_dict.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_with_dict.restype = ctypes.c_int

MAGIC = 0x184D2204
_WINDOW = 64 << 10  # LZ4's match distance: linked blocks see at most this much of what precedes them


class FrameError(ValueError):
    """The bytes are not a well-formed LZ4 frame (the message says where)."""


def xxh3_64(data) -> int:
    """XXH3-64 (seed 0) of any buffer; equals xxhash.xxh3_64_intdigest."""
    arr = np.frombuffer(data, dtype=np.uint8)
    return int(_xxh(arr.ctypes.data, len(arr)))


class Xxh3_128:
    """Streaming XXH3-128 whose update releases the GIL; hexdigest() equals xxhash.xxh3_128's."""

    def __init__(self):
        self._state = _xlib.XXH3_createState()
        if not self._state:
            raise MemoryError("XXH3_createState failed")
        _xlib.XXH3_128bits_reset(self._state)

    def update(self, data) -> None:
        arr = np.frombuffer(data, dtype=np.uint8)
        _xlib.XXH3_128bits_update(self._state, arr.ctypes.data, len(arr))

    def hexdigest(self) -> str:
        h = _xlib.XXH3_128bits_digest(self._state)
        return f"{h.high64:016x}{h.low64:016x}"

    def __del__(self):
        if getattr(self, "_state", None):
            _xlib.XXH3_freeState(self._state)
            self._state = None


def decompress_into(frame, out: np.ndarray) -> int:
    """Decode the LZ4 frame `frame` (any buffer) into the writable, C-contiguous `out`; returns the
    number of bytes written. Raises FrameError on malformed input or when `out` is too small."""
    src = np.frombuffer(frame, dtype=np.uint8)
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be a writable C-contiguous array")
    n_src, base, cap = len(src), out.ctypes.data, out.nbytes
    if n_src < 7 or struct.unpack_from("<I", src, 0)[0] != MAGIC:
        raise FrameError("not an LZ4 frame (bad magic number)")
    flg = src[4]
    if flg >> 6 != 1 or flg & 0x02:
        raise FrameError(f"unsupported frame version or reserved bit set (FLG=0x{flg:02x})")
    if flg & 0x01:
        raise FrameError("frames with a dictionary ID are not supported")
    independent, block_sums, has_size, content_sum = flg & 0x20, flg & 0x10, flg & 0x08, flg & 0x04
    desc_end = 6 + (8 if has_size else 0)
    if n_src < desc_end + 1:
        raise FrameError("truncated frame header")
    if (xxhash.xxh32_intdigest(src[4:desc_end].tobytes()) >> 8) & 0xFF != src[desc_end]:
        raise FrameError("frame header checksum mismatch")
    declared = struct.unpack_from("<Q", src, 6)[0] if has_size else None
    if declared is not None and declared > cap:
        raise FrameError(f"frame holds {declared} bytes, the output buffer {cap}")
    addr, pos, written = src.ctypes.data, desc_end + 1, 0
    while True:
        if pos + 4 > n_src:
            raise FrameError(f"truncated frame: no block header at byte {pos}")
        word = struct.unpack_from("<I", src, pos)[0]
        pos += 4
        if word == 0:
            break
        size = word & 0x7FFFFFFF
        if pos + size + (4 if block_sums else 0) > n_src:
            raise FrameError(f"truncated frame: block at byte {pos - 4} needs {size} bytes")
        if block_sums and xxhash.xxh32_intdigest(src[pos:pos + size].tobytes()) != \
                struct.unpack_from("<I", src, pos + size)[0]:
            raise FrameError(f"block checksum mismatch at byte {pos - 4}")
        if word & 0x80000000:  # stored uncompressed
            if written + size > cap:
                raise FrameError(f"frame decodes to more than the output buffer's {cap} bytes")
            ctypes.memmove(base + written, addr + pos, size)
            got = size
        elif independent or written == 0:
            got = _safe(addr + pos, base + written, size, cap - written)
        else:
            d = min(written, _WINDOW)
            got = _with_dict(addr + pos, base + written, size, cap - written, base + written - d, d)
        if got < 0:
            raise FrameError(f"corrupt LZ4 block at byte {pos - 4} (or output buffer of {cap} bytes too small)")
        written += got
        pos += size + (4 if block_sums else 0)
    if content_sum:
        if pos + 4 > n_src:
            raise FrameError("truncated frame: content checksum missing")
        if xxhash.xxh32_intdigest(out.reshape(-1).view(np.uint8)[:written]) != struct.unpack_from("<I", src, pos)[0]:
            raise FrameError("content checksum mismatch")
    if declared is not None and declared != written:
        raise FrameError(f"frame header says {declared} bytes, blocks decode to {written}")
    return written
