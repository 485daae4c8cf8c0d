"""Fixtures shared by the train tests: a tiny random-init Llama as a smoltrain checkpoint and its HF export."""
from __future__ import annotations

import hashlib

import pytest

from testutil import read_corpus
from tinyllama import CHAT_TOKENS, EOS, SHAPE, random_llama, write_checkpoint


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(HF folder written by `train ckpt export`, the transformers model it came from, EOS id, the checkpoint,
    its dataset folder). The tokenizer reserves ChatML's tokens and the dataset names the chatml template."""
    from click.testing import CliRunner

    from datapipe.tokenize import train_bpe
    from storage.manifest import Manifest, TokenizerInfo, write_manifest
    from train.checkpoint.cli import ckpt

    base = tmp_path_factory.mktemp("evalhf")
    ds = base / "ds"
    texts = [d["text"] for d in read_corpus("shakespeare", 300)] + [d["text"] for d in read_corpus("fortunes", 300)]
    tok_path = train_bpe(texts, 1000, EOS, str(ds / "tokenizer.json"), special_tokens=CHAT_TOKENS)
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(tok_path).token_to_id(EOS)
    sha = hashlib.sha256(open(tok_path, "rb").read()).hexdigest()
    write_manifest(str(ds), Manifest(TokenizerInfo("tokenizer.json", sha, 1000, eos_id, "uint16"), {}, [],
                                     chat_template="chatml"))

    model = random_llama(Tokenizer.from_file(tok_path).get_vocab_size())
    ck = write_checkpoint(str(base / "ckpt"), model,
                           {"model": {"preset": "tiny", **SHAPE}, "tokenizer": str(ds / "tokenizer.json")})
    out = base / "hf"
    r = CliRunner().invoke(ckpt, ["export", ck, str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return str(out), model, eos_id, ck, str(ds)




@pytest.fixture(scope="session")
def tiny_ckpt(tiny_hf, tmp_path_factory) -> str:
    """The tiny Llama imported by `train ckpt import` (a Megatron checkpoint that `--init`, `train eval` and
    RL start from; it carries the HF tokenizer files)."""
    from click.testing import CliRunner

    from train.checkpoint.cli import ckpt

    out = tmp_path_factory.mktemp("tinyckpt") / "ck"
    r = CliRunner().invoke(ckpt, ["import", tiny_hf[0], str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return str(out)
