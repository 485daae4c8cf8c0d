"""Where dropped documents go: `rejects/<reason>/<rank>.jsonl.gz`, one gzip JSONL per task, written by
datatrove's JsonlWriter with a gzip header that carries no time or file name, so a rerun (or a redone
task) writes the same bytes as the first run did."""
from __future__ import annotations

import gzip

from datatrove.pipeline.writers.jsonl import JsonlWriter
from fsspec.compression import compr, register_compression

GZIP = "gzip-reproducible"


def _gzip(f, mode="rb", **kwargs):
    return gzip.GzipFile(filename="", fileobj=f, mode=mode, mtime=0, **kwargs)


if GZIP not in compr:  # registered in every process that unpickles a RejectsWriter (its module is imported)
    register_compression(GZIP, _gzip, [])


class RejectsWriter(JsonlWriter):
    """A task's rejects under `folder` as `${rank}.jsonl.gz` (deterministic gzip)."""

    def __init__(self, folder: str):
        super().__init__(folder, output_filename="${rank}.jsonl.gz", compression=GZIP)
