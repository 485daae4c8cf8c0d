"""Optional DALI backend: block bytes come from DALI's `fn.readers.webdataset` instead of `os.pread`.

Order, packing, checksum and LZ4 decode stay the Python backend's, so both backends yield the same
sequences (tests/loader/test_loader_dali.py). DALI streams a whole shard per pipeline run (its reader
has no random access by key), so a shard is read once on first use and kept in a small LRU of shards.
DALI runs CPU-only here (`device_id=None`); local datasets only (DALI reads files, not URLs). It reads
each shard's own `.idx` (format v1 writes DALI's v1.2 index with data offsets).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from storage import fs
from storage.config import ConfigError
from storage.shards import INDEX_SUFFIX, META_EXT, TOKENS_EXT, ShardReader


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


class DaliBlockReader:
    def __init__(self, dataset, cached_shards: int = 4):
        if not dali_available():
            raise ConfigError("backend 'dali' needs NVIDIA DALI: pip install '.[dali]'")
        if not fs.is_local(dataset.url):
            raise ConfigError(f"backend 'dali' reads local datasets only, got {dataset.url}")
        self._cache: OrderedDict[str, list[tuple[bytes, bytes]]] = OrderedDict()
        self._lock = threading.Lock()
        self._shard_locks: dict[str, threading.Lock] = {}
        self.cached_shards = cached_shards

    def _read_shard(self, sh: ShardReader) -> list[tuple[bytes, bytes]]:
        from nvidia.dali import fn, pipeline_def, types

        n = len(sh.index)

        @pipeline_def(batch_size=n, num_threads=1, device_id=None, prefetch_queue_depth=1)
        def pipe():
            toks, meta = fn.readers.webdataset(
                paths=[fs.local_path(sh.url)], index_paths=[fs.local_path(sh.url) + INDEX_SUFFIX], ext=[TOKENS_EXT, META_EXT],
                missing_component_behavior="error", random_shuffle=False, dtypes=[types.UINT8, types.UINT8])
            return toks, meta

        p = pipe()
        p.build()
        toks, meta = p.run()
        out = [(toks.at(k).tobytes(), meta.at(k).tobytes()) for k in range(n)]
        del p
        return out

    def __call__(self, sh: ShardReader, k: int) -> tuple[bytes, bytes]:
        with self._lock:
            lock = self._shard_locks.setdefault(sh.url, threading.Lock())
        with lock:
            with self._lock:
                blocks = self._cache.get(sh.url)
                if blocks is not None:
                    self._cache.move_to_end(sh.url)
            if blocks is None:
                blocks = self._read_shard(sh)
                with self._lock:
                    self._cache[sh.url] = blocks
                    while len(self._cache) > self.cached_shards:
                        self._cache.popitem(last=False)
        return blocks[k]
