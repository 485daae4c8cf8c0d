"""Console table and JSON of a bench run. `REQUIRED_FIELDS` is the contract the tests check."""
from __future__ import annotations

import json
import os

from storage import atomic
from storage.bench.units import fmt_size

REQUIRED_FIELDS = {
    "report": ["version", "created", "host", "settings", "targets", "shards", "plots"],
    "target": ["target", "kind", "fs_type", "mount", "volatile", "direct", "page_cache", "gds", "results",
               "summary", "checkpoint", "fio", "verdict", "cpu_bound"],
    "point": ["test", "mode", "threads", "io_size", "bytes", "ops", "seconds", "gib_per_s", "iops",
              "lat_p50_us", "lat_p99_us", "resident_before", "resident_after", "io_busy", "cpu_s",
              "cpu_wait"],
    "summary": ["seq_read_gib_per_s", "seq_write_gib_per_s", "rand_read_iops", "rand_read_lat_p50_us",
                "rand_read_lat_p99_us"],
    "verdict": ["need_tokens_per_s", "feeds_need", "feeds_reason", "data_cache", "checkpoints"],
}


def summarize(points: list[dict]) -> dict:
    def best(test: str, key: str):
        vals = [p for p in points if p["test"] == test and p["ops"]]
        return max(vals, key=lambda p: p[key]) if vals else None

    r, w, i = best("seq_read", "gib_per_s"), best("seq_write", "gib_per_s"), best("rand_read", "iops")
    return {"seq_read_gib_per_s": r and r["gib_per_s"], "seq_write_gib_per_s": w and w["gib_per_s"],
            "rand_read_iops": i and i["iops"], "rand_read_lat_p50_us": i and i["lat_p50_us"],
            "rand_read_lat_p99_us": i and i["lat_p99_us"],
            "at": {k: v and f"{v['mode']} {v['threads']}thr {fmt_size(v['io_size'])}"
                   for k, v in (("seq_read", r), ("seq_write", w), ("rand_read", i))}}


def _res(before, after) -> str:
    if before is None:
        return "-"
    return f"{100 * before:.0f}%" + ("" if after is None else f">{100 * after:.0f}%")


def table(report: dict) -> str:
    lines = []
    for t in report["targets"]:
        lines.append(f"\n== {t['target']}  ({t['kind']}, {t['fs_type']} at {t['mount']})")
        lines.append("   cached = share of the file in the page cache at start > end of the point (mincore); "
                     "busy = share of thread time inside I/O calls; cpuwait = share waiting for a CPU")
        lines.append(f"   O_DIRECT: {t['direct']['reason']}")
        lines.append(f"   page cache: {t['page_cache']['note']}")
        lines.append(f"   GPU_DIRECT: {'available' if t['gds']['available'] else 'unavailable'}: {t['gds']['reason']}")
        lines.append(f"   {'test':<10}{'mode':<10}{'thr':>4}{'io':>8}{'GiB/s':>9}{'IOPS':>11}{'p50 us':>10}"
                     f"{'p99 us':>10}{'cached':>10}{'busy':>6}{'cpuwait':>8}")
        for p in t["results"]:
            lines.append(f"   {p['test']:<10}{p['mode']:<10}{p['threads']:>4}{fmt_size(p['io_size']):>8}"
                         f"{p['gib_per_s']:>9.3f}{p['iops']:>11,.0f}{p['lat_p50_us']:>10.1f}{p['lat_p99_us']:>10.1f}"
                         f"{_res(p['resident_before'], p['resident_after']):>10}{100 * p['io_busy']:>5.0f}%{100 * p['cpu_wait']:>7.0f}%")
        for f in t["fio"] or []:
            o, r = f["ours"], f["fio"]
            lines.append(f"   vs fio {f['test']} {f['mode']} {f['threads']}thr {fmt_size(f['io_size'])}: ours "
                         f"{o['gib_per_s']:.3f} GiB/s {o['iops']:,.0f} IOPS | fio {r['gib_per_s']:.3f} GiB/s "
                         f"{r['iops']:,.0f} IOPS | ratio {f['ratio']:.3f}")
        if t["cpu_bound"]["points"]:
            lines.append(f"   CPU-bound: {t['cpu_bound']['note']}")
        if t.get("fio_note"):
            lines.append(f"   vs fio: {t['fio_note']}")
        if t["checkpoint"]:
            c = t["checkpoint"]
            lines.append(f"   checkpoint {fmt_size(c['total_bytes'])} in {c['files']} files: write "
                         f"{c['write_gib_per_s']:.3f} GiB/s, read {c['read_gib_per_s']:.3f} GiB/s")
        v = t["verdict"]
        feeds = {None: "n/a", True: "YES", False: "NO"}[v["feeds_need"]]
        lines.append(f"   verdict: feeds need: {feeds} ({v['feeds_reason']})")
        for use in ("data_cache", "checkpoints"):
            lines.append(f"            {use}: {'fits' if v[use]['fits'] else 'no'} - {v[use]['reason']}")
    s = report.get("shards")
    if s:
        lines.append(f"\n== shards {s['dataset']}: {s['shards']} shards, {s['tokens']:,} tokens in {s['seconds']:.2f} s "
                     f"= {s['tokens_per_s']:,.0f} tokens/s ({s['gib_per_s']:.3f} GiB/s, {s['bytes_per_token']:.2f} "
                     f"B/token, {s['threads']} threads; {s['steps']})")
    return "\n".join(lines)


def write_json(report: dict, out_dir: str) -> str:
    path = os.path.join(out_dir, "bench.json")
    atomic.write_bytes(path, json.dumps(report, indent=1).encode())
    return path
