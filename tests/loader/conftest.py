"""Fixtures for the loader tests: small datasets whose tokens name their source, and a loader factory."""
from __future__ import annotations

import numpy as np
import pytest

from storage.dataset import SourceWriter
from storage.loader import LoaderConfig, TokenLoader
from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest
from storage.shards import TAR_BLOCK

SPAN = 20_000  # source i writes token ids in [i*SPAN + 1, (i+1)*SPAN); 0 is EOS


def make_dataset(root: str, docs: dict[str, int], mix: list[Phase] | None = None, seed: int = 0,
                 block_tokens: int = 1024, shard_blocks: int = 4, long_doc: int = 0) -> Manifest:
    """`docs` maps source → number of random documents; `long_doc` > 0 adds one document of that many
    tokens (all equal to the source's first id + 1) to the first source."""
    rng = np.random.default_rng(seed)
    infos = {}
    for i, (name, n) in enumerate(docs.items()):
        w = SourceWriter(root, name, "uint16", block_tokens=block_tokens, shard_blocks=shard_blocks)
        for d in range(n):
            toks = rng.integers(i * SPAN + 2, (i + 1) * SPAN, int(rng.integers(5, 400)))
            w.add_document(f"{name}-{d}", np.append(toks, 0))
            if long_doc and i == 0 and d == n // 2:
                w.add_document(f"{name}-long", np.append(np.full(long_doc, i * SPAN + 1), 0))
        infos[name] = w.close()
    if mix is None:
        mix = [Phase("all", {n: 1.0 for n in docs}, 10**9)]
    m = Manifest(TokenizerInfo("tok.json", "0" * 64, 65536, 0, "uint16"), infos, mix)
    write_manifest(root, m)
    return m


def source_of_rows(batch) -> np.ndarray:
    """Source index of each row, read from its tokens (rows never mix sources)."""
    return (batch.max(dim=1).values // SPAN).numpy()


@pytest.fixture(scope="module")
def mixed_ds(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("mixed") / "ds")
    make_dataset(root, {"web": 300, "code": 200, "math": 100})
    return root


@pytest.fixture
def loader_factory():
    made = []

    def make(dataset: str, G: int = 8, rank: int = 0, world: int = 1, mix=None, **kw) -> TokenLoader:
        kw.setdefault("seq_len", 32)
        kw.setdefault("seed", 7)
        kw.setdefault("shuffle_window", 16)
        kw.setdefault("prefetch_threads", 2)
        loader = TokenLoader(LoaderConfig(dataset=dataset, **kw), G, rank, world, mix)
        made.append(loader)
        return loader

    yield make
    for loader in made:
        loader.close()


def take(loader, n: int) -> list:
    return [next(loader).clone() for _ in range(n)]


@pytest.fixture(scope="session")
def ld():
    """The helpers above, for test modules (conftest modules are not importable by name)."""
    import types

    return types.SimpleNamespace(make_dataset=make_dataset, source_of_rows=source_of_rows, take=take, SPAN=SPAN)


@pytest.fixture
def corrupt_ds(tmp_path, ld, loader_factory):
    """A dataset with one corrupted block (the one that web's first sequence starts in), plus facts."""
    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 200, "code": 100})
    probe = loader_factory(root)
    clean = ld.take(probe, 12)
    b = probe.orders[0].pieces(0)[0][0]
    sh, k = probe.store.refs[0][b]
    entry = sh.index[k]
    original = sh.read_block(k).tokens.astype(np.int64)
    with open(sh.url, "r+b") as f:
        f.seek(entry.tokens_offset + TAR_BLOCK + entry.tokens_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return {"root": root, "clean": clean, "shard": sh.url, "member": f"{entry.key}.tokens.lz4",
            "offset": entry.tokens_offset, "block": b, "original": original}
