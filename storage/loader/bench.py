"""`storage bench-loader DATASET`: the loader alone — sequences/s, tokens/s, consumer wait, RSS over a run.

It draws batches as a trainer would (optionally sleeping a simulated step between them) and reports
throughput and RSS per `--every` sequences, so a loader that slows down or grows with the step count
shows up as a trend, not hidden in an average.
"""
from __future__ import annotations

import json
import time

import click
import psutil

from storage.loader.config import LoaderConfig
from storage.loader.loader import TokenLoader


def _rss_anon_mib() -> float | None:
    """Anonymous (heap) resident MiB: RSS without the mapped shard pages, which the kernel may drop any time."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_bench(cfg: LoaderConfig, global_batch: int, sequences: int, every: int, step_s: float = 0.0,
              echo=None) -> dict:
    proc = psutil.Process()
    loader = TokenLoader(cfg, global_batch)
    rows, windows = [], []
    try:
        t_start = last_t = time.perf_counter()
        last_c = time.process_time()
        last_n, last_wait, n, step_total = 0, 0.0, 0, 0.0
        while n < sequences:
            batch = next(loader)
            n += batch.shape[0]
            if step_s:
                time.sleep(step_s)
                step_total += step_s
            if n - last_n >= every or n >= sequences:
                now, cpu, m = time.perf_counter(), time.process_time(), loader.metrics()
                row = {"sequences": n, "seq_per_s": (n - last_n) / (now - last_t),
                       "tokens_per_s": (n - last_n) * cfg.seq_len / (now - last_t),
                       "cpu_s_per_1k_seq": (cpu - last_c) / (n - last_n) * 1000,
                       "wait_s": m["wait_s"] - last_wait, "rss_mib": proc.memory_info().rss / 2**20,
                       "rss_anon_mib": _rss_anon_mib(),
                       "bytes_in_flight": m["bytes_in_flight"]}
                rows.append(row)
                windows.append(row)
                if echo:
                    echo(row)
                last_t, last_c, last_n, last_wait = now, cpu, n, m["wait_s"]
        total = time.perf_counter() - t_start
        m = loader.metrics()
    finally:
        loader.close()
    steady = windows[1:-1] if len(windows) > 2 else windows  # the first warms up, the last may be short

    def spread(key):
        v = [r[key] for r in steady]
        return (max(v) - min(v)) / (sum(v) / len(v)) if v else 0.0

    return {"sequences": n, "seconds": total, "tokens_per_s": n * cfg.seq_len / total,
            "seq_per_s": n / total, "wait_s": m["wait_s"],
            "wait_fraction_of_step": (m["wait_s"] / step_total) if step_total else None,
            "throughput_spread": spread("tokens_per_s"), "cpu_per_sequence_spread": spread("cpu_s_per_1k_seq"),
            "rss_mib_first": rows[0]["rss_mib"], "rss_mib_last": rows[-1]["rss_mib"],
            "rss_anon_mib_first": rows[0]["rss_anon_mib"], "rss_anon_mib_last": rows[-1]["rss_anon_mib"],
            "bytes_read": m["bytes_read"], "quarantined_blocks": m["quarantined_blocks"], "windows": rows}


@click.command("bench-loader")
@click.argument("dataset")
@click.option("--seq-len", default=2048, show_default=True)
@click.option("--batch", "global_batch", default=64, show_default=True, help="Global batch size (DP=1).")
@click.option("--sequences", default=200_000, show_default=True, help="Sequences to draw in all.")
@click.option("--every", default=10_000, show_default=True, help="Report a window every N sequences.")
@click.option("--threads", default=0, show_default=True, help="Prefetch threads (0: auto, see LoaderConfig.threads).")
@click.option("--decode-processes", default=-1, show_default=True, help="Decode processes (-1: auto, 0: threads).")
@click.option("--workers", default=0, show_default=True, help="Batch-building worker processes (0: a thread).")
@click.option("--step-ms", default=0.0, show_default=True, help="Simulated training step between batches.")
@click.option("--seed", default=1234, show_default=True)
@click.option("--max-bytes", default=512 << 20, show_default=True, help="max_bytes_in_flight (block cache budget).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def bench_loader(dataset: str, seq_len: int, global_batch: int, sequences: int, every: int, threads: int,
                 decode_processes: int, workers: int,
                 step_ms: float, seed: int, max_bytes: int, as_json: bool) -> None:
    """Measure the streaming loader alone on DATASET (path or URL): throughput, consumer wait and RSS per
    window of --every sequences, to show both speed and that neither drifts over a long run."""
    cfg = LoaderConfig(dataset=dataset, seq_len=seq_len, seed=seed, prefetch_threads=threads,
                       decode_processes=decode_processes, workers=workers,
                       max_bytes_in_flight=max_bytes)
    if not as_json:
        click.echo(f"{'sequences':>10}{'seq/s':>10}{'Mtok/s':>9}{'CPU ms/1k':>10}{'wait s':>9}{'RSS MiB':>9}")

    def echo(r):
        if not as_json:
            click.echo(f"{r['sequences']:>10,}{r['seq_per_s']:>10.0f}{r['tokens_per_s'] / 1e6:>9.2f}"
                       f"{1000 * r['cpu_s_per_1k_seq']:>10.1f}{r['wait_s']:>9.3f}{r['rss_mib']:>9.0f}")

    res = run_bench(cfg, global_batch, sequences, every, step_ms / 1000, echo)
    if as_json:
        click.echo(json.dumps(res, indent=1))
        return
    wait = (f", consumer wait {100 * res['wait_fraction_of_step']:.2f} % of step time"
            if res["wait_fraction_of_step"] is not None else f", consumer wait {res['wait_s']:.2f} s")
    click.echo(f"total: {res['sequences']:,} sequences in {res['seconds']:.1f} s = {res['tokens_per_s'] / 1e6:.2f} "
               f"Mtok/s; window spread (peak to peak / mean): throughput {100 * res['throughput_spread']:.1f} %, CPU per "
               f"sequence {100 * res['cpu_per_sequence_spread']:.1f} %; RSS {res['rss_mib_first']:.0f} → "
               f"{res['rss_mib_last']:.0f} MiB{wait}")
