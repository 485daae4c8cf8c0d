"""train.model.docmask in one gloo process: packed documents (block-diagonal mask + per-document RoPE positions)
give every document the per-token losses it gets alone; boundaries from EOS; thd cu_seqlens."""
import pytest
import torch
from testutil import megatron_one_rank

from train.model.docmask import (block_causal_mask, micro_batch, packed_seq_params, positions_of, rope_positions,
                           segments_from_eos)
from train.model.gpt import ModelConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from train.model.gpt import build_model

    with megatron_one_rank(tmp_path_factory.mktemp("pg")):
        yield build_model(ModelConfig(preset="tiny"), seed=11)


def _alone(model, doc: list[int]) -> torch.Tensor:
    """Per-token losses of one document in a row of its own (plain causal attention, positions 0..)."""
    t = torch.tensor([doc[:-1]])
    with torch.no_grad():
        return model(t, torch.arange(len(doc) - 1).unsqueeze(0), None, labels=torch.tensor([doc[1:]]))[0]


def _packed_losses(model, batch: torch.Tensor, **kw) -> tuple[torch.Tensor, object]:
    mb = micro_batch(batch, varlen=False, **kw)
    with torch.no_grad(), rope_positions([model]) as box:
        box["positions"] = mb.positions
        pos = mb.positions if mb.positions is not None else torch.arange(mb.tokens.shape[1]).expand_as(mb.tokens)
        return model(mb.tokens, pos, mb.attention_mask, labels=mb.labels), mb


def _packed_row(docs: list[list[int]], S: int) -> torch.Tensor:
    row = torch.zeros(4, S, dtype=torch.int64)
    row[3] = -1
    pos = 0
    for s, d in enumerate(docs):
        L = len(d)
        row[0, pos:pos + L] = torch.tensor(d)
        row[1, pos:pos + L - 1] = torch.tensor(d[1:])
        row[2, pos:pos + L - 1] = 1
        row[3, pos:pos + L] = s
        pos += L
    return row


def test_packed_documents_score_as_if_alone(tiny_model):
    (model,) = tiny_model
    g = torch.Generator().manual_seed(0)
    rows = [[17, 9, 21], [30, 25]]
    docs = [[torch.randint(1, 1000, (n,), generator=g).tolist() for n in r] for r in rows]
    S = 80
    batch = torch.stack([_packed_row(d, S) for d in docs])
    losses, mb = _packed_losses(model, batch, document_masking=True, eos_id=None)
    assert int(mb.nonpad) == sum(sum(r) for r in rows)
    for b, row_docs in enumerate(docs):
        pos = 0
        for d in row_docs:
            ref = _alone(model, d)
            got = losses[b, pos:pos + len(d) - 1]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            assert float(mb.loss_mask[b, pos + len(d) - 1]) == 0.0  # a document's last token has no label
            pos += len(d)
    # without the mask the later documents see the earlier ones: the check above can fail
    plain, _ = _packed_losses(model, batch, document_masking=False, eos_id=None)
    d0, d1 = docs[0][0], docs[0][1]
    assert not torch.allclose(plain[0, len(d0):len(d0) + len(d1) - 1], _alone(model, d1), atol=1e-4)


def test_pretraining_rows_split_at_eos(tiny_model):
    (model,) = tiny_model
    eos = 0
    g = torch.Generator().manual_seed(1)
    a = torch.randint(1, 1000, (12,), generator=g).tolist() + [eos]
    b = torch.randint(1, 1000, (20,), generator=g).tolist() + [eos]
    c = torch.randint(1, 1000, (9,), generator=g).tolist()
    row = torch.tensor([a + b + c])  # seq_len + 1 tokens
    losses, mb = _packed_losses(model, row, document_masking=True, eos_id=eos)
    assert mb.loss_mask is None and int(mb.nonpad) == len(a + b + c) - 1
    # document b (after a's EOS) is scored as alone; a's EOS predicts b's first token from a's context
    torch.testing.assert_close(losses[0, len(a):len(a) + len(b) - 1], _alone(model, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[0, :len(a) - 1], _alone(model, a), rtol=1e-5, atol=1e-5)


def test_segments_positions_masks_and_cu_seqlens():
    tokens = torch.tensor([[5, 6, 0, 7, 0, 8, 9, 9]])
    seg = segments_from_eos(tokens, 0)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert positions_of(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    m = block_causal_mask(seg)[0, 0]
    assert not m[4, 3] and m[3, 2] and m[2, 3] and not m[7, 5]
    two = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    p = packed_seq_params(two)
    assert p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, 2, 5, 6, 10, 12] and p.max_seqlen_q == 4
