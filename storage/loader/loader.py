"""`TokenLoader`: this rank's slice of each global batch, in the DP-independent global order.

Global batch i holds global sequences [start + i*G, start + (i+1)*G); rank r of W takes rows
[r*G/W, (r+1)*G/W). A producer thread plans batches ahead (block references → prefetch pool), packs
them and feeds a two-slot queue; the consumer only dequeues. With `workers` > 0, forked worker
processes build the batches instead (`workers`). State is the number of global sequences
consumed plus the mix segments, so a run resumes exactly with any DP size or worker count.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator
from typing import Self

import numpy as np
import torch

from storage import fs
from storage.dataset import Dataset
from storage.loader.blend import Blend, mix_fingerprint
from storage.loader.buffers import CudaStager, Failure, TwoSlotQueue
from storage.loader.config import LoaderConfig
from storage.loader.order import SourceOrder
from storage.loader.pack import Packer, Plan, acquire, finish, plan_steps, release
from storage.loader.prefetch import BlockStore, split_id
from storage.loader.workers import WorkerPool
from storage.manifest import Manifest, Phase, validate_mix
from storage.shards import TAR_BLOCK, ShardReader, parse_dtype

STATE_VERSION = 1
CHUNK_BATCHES = 64  # batches planned together (pack.Chunk)
log = logging.getLogger(__name__)


def dataset_fingerprint(m: Manifest) -> str:
    """Content identity of a dataset (not its location: a local copy and its S3 upload match)."""
    plain = {name: [[sh.sha256, sh.tokens, sh.blocks] for sh in src.shards] for name, src in m.sources.items()}
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16]


def _block_tokens(readers: list[ShardReader], shards, store: BlockStore) -> np.ndarray:
    """Tokens per block: from the manifest when it lists them, else from each block's JSON member."""
    def one(pair):
        sh, info = pair
        if len(info.block_tokens) == len(sh.index):
            return list(info.block_tokens)
        out = []
        for e in sh.index:
            meta = fs.read_range(sh.url, e.meta_offset + TAR_BLOCK, e.meta_size)
            out.append(int(json.loads(meta)["n_tokens"]))
        return out
    return np.array([n for part in store.map(one, zip(readers, shards)) for n in part], dtype=np.int64)


def natural_mix(m: Manifest) -> list[Phase]:
    return [Phase("natural", {n: float(s.tokens) for n, s in m.sources.items()}, 1)]


class TokenLoader:
    def __init__(self, cfg: LoaderConfig, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 mix: list[Phase] | None = None, *, batch_offset: int = 0, batch_stride: int = 1):
        """`batch_offset`/`batch_stride`: this instance yields only batches offset, offset + stride, ...
        (how TokenIterableDataset splits the stream over DataLoader workers)."""
        cfg.validate()
        if global_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad batch layout: global_batch_size={global_batch_size}, dp_rank={dp_rank}, "
                             f"dp_size={dp_size}")
        if global_batch_size % dp_size:
            raise ValueError(f"global_batch_size {global_batch_size} is not divisible by dp_size {dp_size}")
        self.cfg, self.G, self.rank, self.world = cfg, global_batch_size, dp_rank, dp_size
        self.rows = global_batch_size // dp_size
        self.batch_offset, self.batch_stride = batch_offset, batch_stride
        self.ds = Dataset.open(cfg.dataset)
        m = self.ds.manifest
        m.validate()
        self.sources = list(m.sources)
        self.itemsize = parse_dtype(m.tokenizer.dtype).itemsize
        self.fingerprint = {"dataset": dataset_fingerprint(m), "seq_len": cfg.seq_len, "seed": cfg.seed,
                            "shuffle_window": cfg.shuffle_window}
        reader = None
        if cfg.backend == "dali":
            from storage.loader.dali import DaliBlockReader
            reader = DaliBlockReader(self.ds)  # raises ConfigError when DALI is absent
        self.store = BlockStore([], [], self.itemsize, cfg.threads(), cfg.max_bytes_in_flight, reader)
        # shard indexes and block tables are fetched with the prefetch pool (many small reads remotely)
        self.store.map(lambda sh: sh.index, [sh for rs in self.ds.readers.values() for sh in rs])
        self.orders: list[SourceOrder] = []
        for name in self.sources:
            rs, infos = self.ds.readers[name], m.sources[name].shards
            bt = _block_tokens(rs, infos, self.store)
            self.store.refs.append([(sh, k) for sh in rs for k in range(len(sh.index))])
            self.store.block_tokens.append(bt)
            self.orders.append(SourceOrder(name, bt, cfg.seq_len, cfg.seed, cfg.shuffle_window))
        need = self.window_bytes()
        if need > cfg.max_bytes_in_flight:
            log.warning("max_bytes_in_flight %d MiB is below the ~%d MiB of blocks one shuffle window per source "
                        "spans: blocks will be read and decoded many times over", cfg.max_bytes_in_flight >> 20,
                        need >> 20)
        self.mix = list(mix) if mix is not None else (list(m.mix) or natural_mix(m))
        validate_mix(self.mix, self.sources)
        self.blend = Blend(self.sources, cfg.seq_len)
        self.blend.add_segment(0, self.mix)
        self.packer = Packer(self.orders, self.store, cfg.seq_len, cfg.corruption, cfg.max_substitutes)
        self.consumed = 0          # global sequences handed out before this instance's next batch
        self._yielded = 0          # batches handed out by this instance since (re)start
        self._stager = CudaStager(cfg.device) if cfg.device.startswith("cuda") else None
        self._thread: threading.Thread | None = None
        self._pool: WorkerPool | None = None  # cfg.workers > 0: processes build the batches
        self._part: tuple[int, int] | None = None  # in worker process p of n: (p, n), see workers
        self._stop = threading.Event()
        self._buf = TwoSlotQueue(2)
        self._planned: deque[Plan] = deque()
        self._frontier = [-1] * len(self.sources)  # per source: the highest cursor planned (acquired) so far
        self._m = {"wait_s": 0.0, "sequences": 0, "t0": None}

    def window_bytes(self) -> int:
        """Bytes of the blocks that one shuffle window of every source spans (the cache's working set)."""
        total = 0
        for s, o in enumerate(self.orders):
            per_token = sum(self.store.cost((s << 40) | b) for b in range(len(o.block_tokens))) / o.block_tokens.sum()
            total += int(min(o.window, o.n_seq) * o.seq_len * per_token) + 2 * int(o.block_tokens.max()) * 4
        return total

    # ---- order (pure functions, usable without reading any data) ----
    def assignments(self, g0: int, g1: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, cursor in that source) of global sequences [g0, g1)."""
        return self.blend.assign_at(np.arange(g0, g1, dtype=np.int64))

    # ---- producer ----
    @property
    def _running(self) -> bool:
        return self._thread is not None or self._pool is not None

    def _start(self) -> None:
        self.consumed += self._yielded * self.batch_stride * self.G
        self._yielded = 0
        self._frontier = [-1] * len(self.sources)
        if self.cfg.workers:
            finish(self._plan(0, 1))  # fills the blend and order caches once, before the fork copies them
            self._pool = WorkerPool(self, self.cfg.workers, self.cfg.worker_slots)
            return
        if self.cfg.decoders() and self.store.decoder is None:
            self.store.use_decoders(self.cfg.decoders())
        self._stop.clear()
        self._thread = threading.Thread(target=self._produce, name="smoltrain-loader", daemon=True)
        self._thread.start()

    def _plan(self, j: int, n: int) -> Generator[None, None, list[Plan]]:
        """Plans of this instance's batches j .. j + n - 1, one chunk (not yet holding block references), in
        steps (pack.plan_steps)."""
        b = self.batch_offset + (j + np.arange(n, dtype=np.int64)) * self.batch_stride
        g = (self.consumed + b * self.G + self.rank * self.rows)[:, None] + np.arange(self.rows, dtype=np.int64)
        srcs, curs = self.blend.assign_at(g.reshape(-1))
        yield
        return (yield from plan_steps(j, srcs, curs, self.rows, self.orders, self._part))

    def _batches(self) -> Iterator[Plan]:
        """This instance's batch plans in order. Chunks of batches are planned and their blocks requested
        up to prefetch_batches ahead of the batch yielded, within the byte budget (at least one chunk).
        Planning a chunk (~1 ms for 64 batches of 32 rows) takes a few steps, and its block requests one
        more; one of them runs every `pace` batches handed out, so the cost is spread evenly instead of
        landing on one batch in 64. Below half of prefetch_batches planned (the start, a small
        prefetch_batches) they all run at once."""
        j, steps, nxt, since = 0, None, None, 0
        size = min(CHUNK_BATCHES, self.cfg.prefetch_batches)
        pace = max(1, size // 16)
        while True:
            while len(self._planned) < self.cfg.prefetch_batches:
                urgent = len(self._planned) < max(1, self.cfg.prefetch_batches // 2)
                if not urgent and since < pace:
                    break
                if nxt is None:
                    if steps is None:
                        steps, j = self._plan(j, size), j + size
                    nxt = finish(steps, None if urgent else 1)
                    if nxt is not None:
                        steps = None
                    if not urgent:
                        since = 0
                        break
                chunk = nxt[0].chunk
                if self._planned and self.store.bytes_referenced + self.store.new_cost(chunk.blocks) \
                        > self.cfg.max_bytes_in_flight:
                    break
                acquire(chunk, self.store)
                self._planned.extend(nxt)
                for s in np.unique(chunk.srcs).tolist():  # cursors rise with g within a source
                    self._frontier[s] = int(chunk.curs[chunk.srcs == s].max())
                self.store.sweep(self._done_with)
                nxt, since = None, 0
                if not urgent:
                    break
            since += 1
            yield self._planned.popleft()

    def _produce(self) -> None:
        try:
            for p in self._batches():
                if self._stop.is_set():
                    return
                out = torch.from_numpy(self.packer.assemble(p))
                if self._stager is not None:
                    out = CudaStager.pin(out)
                if not self._buf.put(out, self._stop):
                    return
        except Exception as e:  # noqa: BLE001 - any failure is handed to the consumer, in order
            self._buf.put(Failure(e), self._stop)

    def _done_with(self, bid: int) -> bool:
        """Whether a cached block may go: no reader needs it within one shuffle window of the planned
        frontier. Keeping blocks for later uses (the next epoch's) would grow the cache into memory touched
        for the first time mid-run, page faults in the critical path, for hits a dataset larger than the
        budget rarely gets; and a dataset smaller than the budget pays that growth in its first epoch."""
        s, b = split_id(bid)
        k = self._frontier[s]
        return k >= 0 and self.orders[s].done_with(b, k, self.orders[s].window)

    # ---- consumer ----
    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> torch.Tensor:
        if not self._running:
            self._start()
            self._m["t0"] = time.perf_counter()
        if self._stager is not None:
            batch = self._stager.take()
            if batch is None:  # first call: stage one, then hand it out below
                self._stager.stage(self._get())
                batch = self._stager.take()
            self._stager.stage(self._get())
        else:
            batch = self._get()
        self._yielded += 1
        self._m["sequences"] += self.rows
        return batch

    def _get(self) -> torch.Tensor:
        t = time.perf_counter()
        if self._pool is not None:
            item = self._pool.take()
            if self._stager is not None:
                item = CudaStager.pin(item)
        else:
            item = self._buf.get(alive=lambda: self._thread is not None and self._thread.is_alive())
        self._m["wait_s"] += time.perf_counter() - t
        if isinstance(item, Failure):
            raise item.exc
        return item

    # ---- state ----
    def state_dict(self) -> dict:
        consumed = self.consumed + self._yielded * self.batch_stride * self.G
        return {"version": STATE_VERSION, "consumed": consumed, "config": dict(self.fingerprint),
                "mix": mix_fingerprint(self.blend.segments[-1][1]), "segments": self.blend.state()}

    def load_state_dict(self, sd: dict) -> None:
        """Continue after sd["consumed"] global sequences; a different mix given to this loader applies
        from there on (the sources' cursors carry over, so nothing repeats or is skipped)."""
        if sd.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {sd.get('version')!r} is not {STATE_VERSION}")
        for key, ours in self.fingerprint.items():
            if sd["config"].get(key) != ours:
                raise ValueError(f"loader state was made with {key}={sd['config'].get(key)!r}, this loader has "
                                 f"{key}={ours!r}; resuming would change the sequence order")
        self._shutdown()
        consumed = int(sd["consumed"])
        blend = Blend.from_state(self.sources, self.cfg.seq_len, sd["segments"])
        if mix_fingerprint(blend.segments[-1][1]) != mix_fingerprint(self.mix):
            blend.add_segment(consumed, self.mix)
        self.blend, self.consumed, self._yielded = blend, consumed, 0

    # ---- metrics / lifecycle ----
    def metrics(self) -> dict:
        """Throughput and wait since the first batch; block and quarantine counts of the thread, or of
        the current worker processes (summed) when cfg.workers > 0."""
        el = time.perf_counter() - self._m["t0"] if self._m["t0"] else 0.0
        seqs = self._m["sequences"]
        out = {"sequences_per_s": seqs / el if el else 0.0, "tokens_per_s": seqs * self.cfg.seq_len / el if el else 0.0,
               "sequences": seqs, "wait_s": self._m["wait_s"]}
        if self._pool is not None:
            return out | self._pool.metrics() | {"prefetch_depth": self._pool.ready_batches()}
        return out | {"bytes_read": self.store.bytes_read, "blocks_read": self.store.blocks_read,
                      "bytes_in_flight": self.store.bytes_in_flight, "bytes_cached": self.store.bytes_idle,
                      "peak_bytes_in_flight": self.store.peak_bytes_in_flight,
                      "prefetch_depth": self._buf.qsize() + len(self._planned),
                      "quarantined_blocks": len(self.store.bad), "substituted_sequences": self.packer.substituted}

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._thread is not None:
            self._stop.set()
            self._buf.drain()
            self._thread.join()
            self._thread = None
        for c in {id(p.chunk): p.chunk for p in self._planned}.values():
            release(c, self.store)
        self._planned.clear()
        self._buf.drain()
        if self._stager is not None:
            self._stager.take()

    def close(self) -> None:
        self._shutdown()
        self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
