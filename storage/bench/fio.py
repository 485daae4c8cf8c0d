"""`--vs-fio`: the fio job equivalent to one of our test points, on the same file, parsed from fio's JSON.

Equivalence: psync engine (pread/pwrite, like ours), `--thread`, one job per thread; sequential jobs each
cover their own region (`size` = file/T, `offset_increment` = file/T, `runtime` caps, no `time_based`);
random reads span the whole file for `runtime` seconds (`time_based`, `norandommap`); buffered jobs let
fio drop the file's cache first (`invalidate=1`), as we do with posix_fadvise(DONTNEED).
"""
from __future__ import annotations

import json
import shutil
import subprocess

FIO_RW = {"seq_read": "read", "rand_read": "randread", "seq_write": "write"}


def available() -> tuple[bool, str]:
    exe = shutil.which("fio")
    if not exe:
        return False, "fio not found on PATH (Debian/Ubuntu: apt-get install fio; or `make sysdeps`)"
    try:
        ver = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"fio does not run: {e}"
    return True, ver


def job_args(path: str, file_size: int, test: str, mode: str, threads: int, io_size: int, duration: float) -> list[str]:
    args = ["fio", "--name=smoltrain", f"--filename={path}", f"--rw={FIO_RW[test]}", f"--bs={io_size}",
            f"--direct={1 if mode == 'direct' else 0}", "--ioengine=psync", "--thread", f"--numjobs={threads}",
            "--group_reporting", "--output-format=json", "--invalidate=1", f"--runtime={max(1, round(duration))}s"]
    if test == "rand_read":
        args += [f"--size={file_size}", "--time_based", "--norandommap", "--randrepeat=0"]
    else:
        region = (file_size // threads) // io_size * io_size
        args += [f"--size={region}", f"--offset_increment={region}"]
        if test == "seq_write":
            args += ["--end_fsync=1"]
    return args


def run(path: str, file_size: int, test: str, mode: str, threads: int, io_size: int, duration: float) -> dict:
    """fio's figures for the job, in the same fields as our Point (gib_per_s, iops, lat_p50_us, lat_p99_us)."""
    args = job_args(path, file_size, test, mode, threads, io_size, duration)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=duration * 4 + 60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed (exit {proc.returncode}) on {path}: {proc.stderr.strip()[-500:]}")
    text = proc.stdout
    data = json.loads(text[text.index("{"):])
    job = data["jobs"][0]
    side = job["write" if test == "seq_write" else "read"]
    pct = side.get("clat_ns", {}).get("percentile", {})
    secs = max(side.get("runtime", 0) / 1e3, 1e-9)
    return {"tool": data.get("fio version", "fio"), "command": " ".join(args), "bytes": side["io_bytes"],
            "seconds": secs, "gib_per_s": round(side["bw_bytes"] / 2**30, 6), "iops": round(side["iops"], 1),
            "lat_p50_us": round(pct.get("50.000000", 0) / 1e3, 2), "lat_p99_us": round(pct.get("99.000000", 0) / 1e3, 2)}
