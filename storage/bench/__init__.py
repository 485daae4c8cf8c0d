"""`storage bench`: throughput, IOPS and latency of the storage tiers a training run touches.

Modules:
- units.py: size parsing/formatting ("64K", "8MiB").
- target.py: what a target is (local directory or fsspec URL), preflight checks that run before any
  I/O (exists, writable, free space), and the registry that removes test files, also on Ctrl-C.
- io.py: the shared thread runner and statistics, and the local-file engine (buffered / O_DIRECT,
  posix_fadvise(DONTNEED) eviction, mincore residency).
- s3.py: the object-store engine (s3fs range GETs and multipart uploads).
- workloads.py: `--shards` (fetch + sha256 + LZ4 decode, tokens/s) and `--checkpoint` (N files).
- gds.py: GPUDirect Storage through kvikio, or the exact reason it is unavailable.
- fio.py: the equivalent fio jobs for `--vs-fio`.
- verdict.py: can a tier feed a token rate, and which use (data cache, checkpoints) fits it.
- report.py / plots.py: console table, JSON, PNG plots.
- cli.py: the click command `bench`, registered on `storage`.
"""
