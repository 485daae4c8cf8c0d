"""Fixtures for the datapipe tests."""
from __future__ import annotations

import pytest

from testutil import read_corpus


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> str:
    """A 1k BPE trained on a slice of pydoc (fast; shared by the build tests)."""
    from datapipe.tokenize import train_bpe

    texts = [d["text"] for d in read_corpus("pydoc", 300)]
    return train_bpe(texts, 1024, "<|endoftext|>", str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))
