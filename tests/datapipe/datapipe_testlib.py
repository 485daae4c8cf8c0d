"""Helpers for the datapipe tests (imported by name: conftest puts this folder on sys.path)."""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORPORA = REPO.parent / "shared" / "corpora"


def corpus_path(name: str) -> Path:
    p = CORPORA / f"{name}.jsonl.gz"
    if not p.exists():
        pytest.skip(f"corpus {p} is absent (expected at <repo>/../shared/corpora)")
    return p


def read_corpus(name: str, limit: int | None = None, start: int = 0) -> list[dict]:
    out = []
    with gzip.open(corpus_path(name), "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if limit is not None and len(out) >= limit:
                break
            out.append(json.loads(line))
    return out


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


