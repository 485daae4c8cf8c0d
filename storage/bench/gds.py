"""GPUDirect Storage through kvikio: reads into device memory, or the exact reason it cannot run.

Checked in order: kvikio importable (`pip install .[gds]`), a CUDA driver and device visible, the
filesystem one cuFile can use (not tmpfs/overlay/network FS without GDS support), and kvikio not in
compatibility mode (in compat mode it falls back to POSIX reads, which would not be GPU_DIRECT numbers).
Nothing is measured unless every check passes.
"""
from __future__ import annotations

import ctypes
import time

from storage.bench.io import make_point

UNSUPPORTED_FS = {"tmpfs", "ramfs", "overlay", "fuse", "nfs", "nfs4", "cifs", "9p", "virtiofs"}


def _cuda_driver() -> str | None:
    """None if a CUDA driver with at least one device answers; else why not."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda.so.1 not found)"
    if cuda.cuInit(0) != 0:
        return "CUDA driver present but cuInit failed (no usable GPU?)"
    n = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value == 0:
        return "CUDA driver present but no GPU device"
    return None


def probe(fs_type: str, kind: str) -> tuple[bool, str]:
    """(available, reason) for GPU_DIRECT reads on a target of this filesystem type."""
    if kind != "local":
        return False, f"{fs_type}:// is an object store: GDS reads local or GDS-enabled filesystems only"
    try:
        import kvikio
    except ImportError:
        return False, "kvikio is not installed (pip install '.[gds]')"
    why = _cuda_driver()
    if why:
        return False, why
    if fs_type in UNSUPPORTED_FS:
        return False, f"filesystem {fs_type} is not supported by cuFile/GPUDirect Storage"
    try:
        import kvikio.defaults
        compat = kvikio.defaults.compat_mode() if hasattr(kvikio.defaults, "compat_mode") else \
            kvikio.defaults.get_compat_mode()
    except Exception as e:  # noqa: BLE001 - any failure here means we cannot trust the mode
        return False, f"cannot read kvikio's compatibility mode ({type(e).__name__}: {e})"
    if compat and str(compat) not in ("CompatMode.OFF", "0", "False"):
        return False, ("kvikio runs in compatibility mode (cuFile / nvidia-fs driver not available): its reads "
                       "would be POSIX reads, not GPU_DIRECT")
    return True, "kvikio with cuFile (GPUDirect Storage)"


def gds_read(path: str, file_size: int, io_sizes: list[int], duration: float) -> list[dict]:
    """Sequential reads of the file into device memory with kvikio.CuFile.pread, one point per I/O size."""
    import cupy
    import kvikio

    out = []
    for size in io_sizes:
        buf = cupy.empty(size, dtype=cupy.uint8)
        lats, off = [], 0
        t0 = time.perf_counter_ns()
        deadline = t0 + int(duration * 1e9)
        with kvikio.CuFile(path, "r") as f:
            while off + size <= file_size:
                t = time.perf_counter_ns()
                n = f.pread(buf, size, off).get()
                lats.append(time.perf_counter_ns() - t)
                if n != size:
                    raise OSError(f"{path}: GDS short read of {n} bytes at offset {off}")
                off += size
                if t > deadline:
                    break
        secs = (time.perf_counter_ns() - t0) / 1e9
        out.append(make_point("seq_read", "gpu_direct", 1, size, off, lats, secs).to_dict())
    return out
