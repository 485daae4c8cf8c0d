"""Test helpers importable from any test module: corpora access, small shard-format datasets, and
killable subprocess runs."""
from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from storage.dataset import SourceWriter
from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO.parent / "shared" / "corpora"


def corpus_path(name: str) -> Path:
    """../shared/corpora/NAME.jsonl.gz beside the repo (skips the test when the corpora are absent)."""
    p = CORPORA / f"{name}.jsonl.gz"
    if not p.exists():
        pytest.skip(f"corpus {p} is absent (expected at <repo>/../shared/corpora)")
    return p


def read_corpus(name: str, limit: int | None = None, start: int = 0) -> list[dict]:
    """Documents start .. start + limit of a corpus."""
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


def write_random_dataset(root: str, sources: dict[str, int], vocab_size: int = 50_000, seed: int = 0,
                         block_tokens: int = 2048, shard_blocks: int = 4, eos_id: int = 0,
                         mix: list[Phase] | None = None) -> Manifest:
    """A dataset of random documents: `sources` maps name → number of documents."""
    rng = np.random.default_rng(seed)
    dtype = "uint16" if vocab_size <= 65536 else "uint32"
    infos = {}
    for name, n_docs in sources.items():
        w = SourceWriter(root, name, dtype, block_tokens=block_tokens, shard_blocks=shard_blocks)
        for i in range(n_docs):
            doc = rng.integers(1, vocab_size, int(rng.integers(5, 700)))
            w.add_document(f"{name}-{i}", np.append(doc, eos_id))
        infos[name] = w.close()
    if mix is None:
        mix = [Phase("stable", {n: 1.0 for n in sources}, sum(i.tokens for i in infos.values()))]
    m = Manifest(TokenizerInfo("tokenizer.json", "0" * 64, vocab_size, eos_id, dtype), infos, mix)
    write_manifest(root, m)
    return m




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_killable(cmd: list[str], log, kill_when=None, timeout: float = 400, env: dict | None = None):
    """Run cmd in its own process group, output appended to `log`; when kill_when() turns True,
    kill -9 the whole group (torchrun and its workers) and return "killed", else the exit code.
    Leftover processes of the group (e.g. checkpoint writer helpers) are killed either way."""
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        try:
            deadline = time.time() + timeout
            while p.poll() is None and time.time() < deadline:
                if kill_when is not None and kill_when():
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    return "killed"
                time.sleep(0.01)
            return p.wait(timeout=1)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def metric_records(run_dir) -> list[dict]:
    """The step records of RUN_DIR/metrics.jsonl (a killed run's cut last line is ignored)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r:
            out.append(r)
    return out
