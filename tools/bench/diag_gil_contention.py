"""Why the loader's packing slows down beside its own decode threads: the same batch copy (32 pieces of
2049 uint16 tokens widened into an int64 batch, `np.concatenate`, as `Packer.assemble` does) timed alone,
beside a thread that LZ4-decodes blocks (`storage.codec`, GIL released during the decode), and beside a
process doing the same decode. A slowdown with the thread but not with the process is the GIL being
passed back and forth, not memory bandwidth.

    python tools/bench/diag_gil_contention.py [--batches 400] [--repeats 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time

import numpy as np

from storage import codec
from storage.shards import encode_tokens

BLOCK = 262_144


def _decode_forever(frames: list[bytes], stop) -> None:
    bufs = [np.empty(BLOCK, dtype=np.uint16) for _ in frames]
    while not stop.is_set():
        for f, b in zip(frames, bufs):
            codec.decompress_into(f, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 30000, BLOCK).astype(np.uint16) for _ in range(128)]
    pieces = [[blocks[rng.integers(128)][a:a + 2049] for a in rng.integers(0, BLOCK - 2049, 32).tolist()]
              for _ in range(args.batches)]
    out = np.empty(32 * 2049, dtype=np.int64)
    frames = [encode_tokens(b, np.dtype("<u2")) for b in blocks[:16]]

    def per_batch_us() -> float:
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for ps in pieces:
                np.concatenate(ps, out=out)
            runs.append(1e6 * (time.perf_counter() - t) / len(pieces))
        return statistics.median(runs)

    def beside(runner, stop) -> float:
        """per_batch_us() while `runner` (a thread or process running _decode_forever) decodes."""
        runner.start()
        time.sleep(0.2)
        try:
            return per_batch_us()
        finally:
            stop.set()
            runner.join()

    alone = per_batch_us()
    stop = threading.Event()
    with_thread = beside(threading.Thread(target=_decode_forever, args=(frames, stop)), stop)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    with_process = beside(ctx.Process(target=_decode_forever, args=(frames, stop)), stop)
    print(f"batch copy, median of {args.repeats} x {args.batches} batches: alone {alone:.0f} us; beside a decode "
          f"thread {with_thread:.0f} us ({with_thread / alone:.1f}x); beside a decode process {with_process:.0f} us "
          f"({with_process / alone:.1f}x)")


if __name__ == "__main__":
    main()
