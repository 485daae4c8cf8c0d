"""Test helpers importable from any test module: corpora access and small shard-format datasets."""
from __future__ import annotations

import gzip
import json
import socket
from pathlib import Path

import numpy as np
import pytest

from storage.dataset import SourceWriter
from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO.parent / "shared" / "corpora"


def read_corpus(name: str, limit: int | None = None) -> list[dict]:
    """Documents of ../shared/corpora/NAME.jsonl.gz (skips the test when the corpora are absent)."""
    path = CORPORA / f"{name}.jsonl.gz"
    if not path.exists():
        pytest.skip(f"corpus {path} not present (expected at ../shared/corpora beside the repo)")
    docs = []
    with gzip.open(path, "rt") as f:
        for line in f:
            docs.append(json.loads(line))
            if limit is not None and len(docs) >= limit:
                break
    return docs


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
