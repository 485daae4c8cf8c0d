"""Verdict per tier: can it feed a token rate, and does it fit as data cache and/or checkpoint store.

Rules (thresholds are module constants, printed in every reason):
- Bytes needed per second = tokens/s x bytes per token on storage (measured by `--shards`, else 2 for
  uncompressed uint16 tokens, the worst case for vocab <= 65,536). A tier feeds the rate if its best
  sequential read, or the measured shard streaming rate, is at least HEADROOM x that.
- Data cache: not an object store (per-request latency; the playbook copies data to local NVMe), random
  read p99 at the smallest I/O size and fewest threads <= DATA_CACHE_P99_MS, and it feeds the rate (or, with no rate given,
  reads >= DATA_CACHE_MIN_GIBS).
- Checkpoints: durable (not tmpfs/ramfs), and writing a checkpoint of the given size (`--checkpoint`, else
  REFERENCE_CKPT) at the measured write rate takes <= CKPT_BUDGET_S.
"""
from __future__ import annotations

from storage.bench.units import fmt_size

HEADROOM = 2.0
DATA_CACHE_P99_MS = 10.0
DATA_CACHE_MIN_GIBS = 1.0
REFERENCE_CKPT = 10 << 30
CKPT_BUDGET_S = 300.0
DEFAULT_BYTES_PER_TOKEN = 2.0


def _best(points: list[dict], test: str) -> dict | None:
    pts = [p for p in points if p["test"] == test and p["ops"] > 0]
    return max(pts, key=lambda p: p["gib_per_s"]) if pts else None


def _where(p: dict) -> str:
    return f"{p['mode']}, {p['threads']} threads, {fmt_size(p['io_size'])}"


def tier_verdict(t: dict, need_tokens_per_s: float | None, bytes_per_token: float | None,
                 ckpt_size: int | None, shards: dict | None = None) -> dict:
    pts = t["results"]
    bpt = bytes_per_token or DEFAULT_BYTES_PER_TOKEN
    bpt_src = "measured by --shards" if bytes_per_token else "assumed: uncompressed uint16"
    read, write = _best(pts, "seq_read"), _best(pts, "seq_write")
    read_bps = read["gib_per_s"] * 2**30 if read else 0.0
    out: dict = {"need_tokens_per_s": need_tokens_per_s, "bytes_per_token": bpt, "bytes_per_token_source": bpt_src,
                 "best_seq_read": read and {k: read[k] for k in ("mode", "threads", "io_size", "gib_per_s")},
                 "best_seq_write": write and {k: write[k] for k in ("mode", "threads", "io_size", "gib_per_s")}}
    feeds, feeds_reason = None, "no --need-tokens-per-s given"
    if need_tokens_per_s:
        need = need_tokens_per_s * bpt
        have = read_bps / need if need else float("inf")
        feeds = have >= HEADROOM
        feeds_reason = (f"best sequential read {read_bps / 2**30:.2f} GiB/s = {have:.1f}x the "
                        f"{need / 2**20:.1f} MiB/s needed ({need_tokens_per_s:,.0f} tokens/s x {bpt:.2f} B/token, "
                        f"{bpt_src}); rule: >= {HEADROOM:g}x")
        if shards and shards.get("tokens_per_s"):
            ok = shards["tokens_per_s"] >= HEADROOM * need_tokens_per_s
            feeds_reason += (f"; shard streaming {shards['tokens_per_s']:,.0f} tokens/s = "
                             f"{shards['tokens_per_s'] / need_tokens_per_s:.1f}x the need")
            feeds = feeds and ok
    out["feeds_need"], out["feeds_reason"] = feeds, feeds_reason

    rand = [p for p in pts if p["test"] == "rand_read" and p["ops"] > 0]
    small = min((p["io_size"] for p in rand), default=None)
    # intrinsic latency: the fewest threads (queueing at high thread counts is the caller's choice)
    lat_pt = min((p for p in rand if p["io_size"] == small), key=lambda p: p["threads"], default=None)
    p99 = lat_pt["lat_p99_us"] if lat_pt else None
    if t["kind"] == "object":
        why = (f"object store: every read is a network request (p99 {(p99 or 0) / 1e3:.1f} ms); copy shards to "
               "local disk for training (the Smol playbook's fix)")
        dc = (False, why)
    elif p99 is not None and p99 / 1e3 > DATA_CACHE_P99_MS:
        dc = (False, f"random-read p99 {p99 / 1e3:.1f} ms at {fmt_size(small)} > {DATA_CACHE_P99_MS:g} ms")
    elif feeds is False:
        dc = (False, feeds_reason)
    elif read is None:
        dc = (False, "no sequential read measured (see --tests)")
    elif feeds is None and read_bps / 2**30 < DATA_CACHE_MIN_GIBS:
        dc = (False, f"sequential read {read_bps / 2**30:.2f} GiB/s < {DATA_CACHE_MIN_GIBS:g} GiB/s")
    else:
        lat = f"random-read p99 {p99 / 1e3:.2f} ms at {fmt_size(small)}" if p99 is not None else "no random reads"
        dc = (True, f"reads {read_bps / 2**30:.2f} GiB/s ({_where(read) if read else '-'}), {lat}"
              + ("; RAM-backed, so capacity is limited by memory" if t.get("volatile") else ""))
    out["data_cache"] = {"fits": dc[0], "reason": dc[1]}

    ck = t.get("checkpoint")
    size = ckpt_size or REFERENCE_CKPT
    w_gibs = ck["write_gib_per_s"] if ck else (write["gib_per_s"] if write else 0.0)
    src = "--checkpoint run" if ck else "best sequential write"
    if t.get("volatile"):
        cp = (False, f"{t['fs_type']} is memory: a checkpoint there is lost on reboot or crash")
    elif w_gibs <= 0:
        cp = (False, "no write measurement")
    else:
        secs = size / (w_gibs * 2**30)
        why = f"{fmt_size(size)} checkpoint in {secs:.1f} s at {w_gibs:.2f} GiB/s ({src}); rule: <= {CKPT_BUDGET_S:g} s"
        cp = (secs <= CKPT_BUDGET_S, why)
    out["checkpoints"] = {"fits": cp[0], "reason": cp[1]}
    return out
