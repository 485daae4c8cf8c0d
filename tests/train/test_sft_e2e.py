"""SFT end to end on a chat dataset built by `datapipe build` (conversations made from stdlib docstrings):
the packed loader's labels and loss mask are the shards' tokens and masks; a trainer step's loss equals
transformers' on the exported model (each conversation alone, masked mean over the step's loss tokens)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from testutil import free_port, metric_records, require, run_killable

from datapipe.demo import chat_docs
from storage.dataset import Dataset
from storage.loader import LoaderConfig
from storage.loader.conversations import ConversationLoader

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
SEQ = 256


@pytest.fixture(scope="module")
def chat_ds(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("chat")
    src = tmp / "chat.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in chat_docs(300)))
    cfg = {"output": str(tmp / "ds"), "tokenizer": {"vocab_size": 1024}, "validation": {"fraction": 0.1},
           "sources": [{"name": "qa", "paths": [str(src)], "format": "chat", "chat": {"max_tokens": SEQ}}]}
    (tmp / "build.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp / "log.txt"
    assert run_killable([str(BIN / "datapipe"), "build", "--quiet", str(tmp / "build.yaml")], log) == 0, \
        log.read_text()[-3000:]
    return tmp / "ds"


def _shard_docs(ds: Path) -> dict[bytes, np.ndarray]:
    """tokens → mask of every conversation in the training shards."""
    out = {}
    for readers in Dataset.open(str(ds)).readers.values():
        for r in readers:
            for k in range(len(r.index)):
                b = r.read_block(k)
                assert b.mask is not None
                for i in range(len(b.doc_ids)):
                    a, z = b.offsets[i], b.offsets[i + 1]
                    out[b.tokens[a:z].astype(np.int64).tobytes()] = b.mask[a:z].astype(np.int64)
    return out


def _pieces(row: torch.Tensor):
    seg = row[3]
    for s in range(int(seg.max()) + 1):
        idx = torch.nonzero(seg == s).flatten()
        yield row[0, idx], row[1, idx], row[2, idx]


def test_loader_masks_are_the_shards(chat_ds):
    docs = _shard_docs(chat_ds)
    with ConversationLoader(LoaderConfig(dataset=str(chat_ds), seq_len=SEQ, seed=1), 4) as ld:
        rows = ld.build(0, ld.epoch_rows(0))
        assert ld.plan(0).split_documents == 0 and ld.plan(0).efficiency > 0.9
    seen = 0
    for row in rows:
        for tok, lab, mask in _pieces(row):
            ref_mask = docs[tok.numpy().tobytes()]
            assert torch.equal(lab[:-1], tok[1:])
            assert np.array_equal(mask.numpy(), np.append(ref_mask[1:], 0))  # the mask of each label token
            seen += 1
    assert seen == len(docs) and 0 < int(rows[:, 2].sum()) < int((rows[:, 3] >= 0).sum())


def _train(tmp: Path, name: str, ds: Path, log: Path, *args, **over) -> Path:
    cfg = {"run_dir": str(tmp / name), "steps": 1, "seed": 5, "objective": "sft", "model": {"preset": "tiny"},
           "data": {"dataset": str(ds), "seq_len": SEQ, "seed": 1},
           "parallel": {"global_batch_size": 4, "micro_batch_size": 2},
           "optim": {"lr": 1.0e-3, "warmup_steps": 0}, "monitor": {"log_every": 1, "tensorboard": False},
           "checkpoint": {"full_every": 1, "incremental_every": 0}, **over}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [str(BIN / "train"), "launch", str(path), "--nproc", "1",
           "--set", f"launch.rdzv_endpoint=127.0.0.1:{free_port()}", *args]
    assert run_killable(cmd, log) == 0, log.read_text()[-4000:]
    return tmp / name


def test_sft_step_loss_equals_transformers_on_the_export(tmp_path, chat_ds):
    require("transformers")
    from transformers import LlamaForCausalLM

    log = tmp_path / "log.txt"
    first = _train(tmp_path, "first", chat_ds, log)
    ckpt = sorted((first / "checkpoints").glob("step_*"))[-1]
    hf = tmp_path / "hf"
    assert run_killable([str(BIN / "train"), "ckpt", "export", str(ckpt), str(hf)], log) == 0, log.read_text()[-3000:]
    # a new run from those weights: its first step's loss is theirs on that run's first batch
    second = _train(tmp_path, "second", chat_ds, log, "--init", str(ckpt))
    (rec,) = [r for r in metric_records(second) if r["step"] == 1]

    with ConversationLoader(LoaderConfig(dataset=str(chat_ds), seq_len=SEQ, seed=1), 4) as ld:
        batch = next(ld)
    model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in batch:
            for tok, lab, mask in _pieces(row):
                logits = model(tok[None]).logits[0].double()
                nll = torch.nn.functional.cross_entropy(logits, lab, reduction="none")
                total += float((nll * mask).sum())
                count += int(mask.sum())
    assert rec["loss_tokens"] == count
    assert rec["loss"] == pytest.approx(total / count, rel=1e-5)

    # train eval scores the SFT checkpoint's held-out conversations as SFT trains: masked, each alone
    out = tmp_path / "eval"
    cmd = [str(BIN / "train"), "eval", str(ckpt), "--tasks", "piqa", "--limit", "8", "--validation-tokens", "1500",
           "--out", str(out)]
    assert run_killable(cmd, log) == 0, log.read_text()[-3000:]
    (res,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    from storage.dataset import iter_documents
    from storage.manifest import read_manifest

    total, count = 0.0, 0
    with torch.no_grad():
        for _, toks, mask in iter_documents(str(chat_ds), read_manifest(str(chat_ds)).validation["qa"].shards,
                                            with_mask=True):
            t = torch.as_tensor(toks.astype(np.int64))[:SEQ + 1]
            m = torch.as_tensor(mask.astype(np.int64))[1:len(t)]
            logits = model(t[None, :-1]).logits[0].double()
            total += float((torch.nn.functional.cross_entropy(logits, t[1:], reduction="none") * m).sum())
            count += int(m.sum())
            if count >= 1500:
                break
    assert res["metrics"]["val/qa/tokens"] == count
    assert res["metrics"]["val/qa/loss"] == pytest.approx(total / count, rel=1e-5)
    assert "eval/piqa/acc_norm" in res["metrics"]
