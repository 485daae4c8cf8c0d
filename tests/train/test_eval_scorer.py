"""train.eval.scorer in one gloo process: tree rows (shared prefix, per-branch RoPE positions, explicit
mask) give each candidate the log-likelihood of its own causal row; scores do not depend on the batch."""
import pytest
import torch
from testutil import megatron_one_rank

from storage.config import ConfigError
from train.model.gpt import ModelConfig


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from train.model.gpt import build_model

    with megatron_one_rank(tmp_path_factory.mktemp("pg")):
        yield build_model(ModelConfig(preset="tiny"), seed=5)


class _Par:
    dp, dp_rank, pp, is_last_stage, device = 1, 0, 1, True, torch.device("cpu")


def _direct(model, inputs, labels, scored):
    """Candidate log-likelihood from a plain causal forward of its own row."""
    out = []
    with torch.no_grad():
        for x, y, s in zip(inputs, labels, scored):
            t = torch.tensor([x])
            loss = model(t, torch.arange(len(x)).unsqueeze(0), None, labels=torch.tensor([y]))
            out.append(float(-loss[0, len(x) - s:].double().sum()))
    return out


def _candidates(g, ctx_len, cont_lens, shared=True):
    ctx = torch.randint(1, 1000, (ctx_len,), generator=g).tolist()
    inputs, labels, scored = [], [], []
    for j, n in enumerate(cont_lens):
        c = ctx if shared else ctx[:-3] + torch.randint(1, 1000, (3,), generator=g).tolist()
        whole = c + torch.randint(1, 1000, (n,), generator=g).tolist()
        inputs.append(whole[:-1])
        labels.append(whole[1:])
        scored.append(n)
    return inputs, labels, scored


def test_tree_rows_equal_separate_rows_and_batching(tiny_model):
    from train.eval.scorer import Scorer, flat_rows, supports_trees, tree_row

    (model,) = tiny_model
    model.eval()
    assert supports_trees(tiny_model)
    g = torch.Generator().manual_seed(0)
    items = [_candidates(g, 20 + 7 * i, [3 + i, 9, 1, 5][: 2 + i % 3], shared=i % 2 == 0) for i in range(6)]
    direct = [_direct(model, *it) for it in items]
    tree = [tree_row(*it) for it in items]
    assert len(tree[0].tokens) < sum(len(x) for x in items[0][0])  # the context is encoded once
    scorer = Scorer(tiny_model, _Par(), batch_tokens=10_000)
    together = scorer.score(tree)
    alone = [Scorer(tiny_model, _Par()).score([r])[0] for r in tree]
    flat = scorer.score([r for it in items for r in flat_rows(*it)])
    flat_it = iter(flat)
    for d, t, a, it in zip(direct, together, alone, items):
        f = [next(flat_it)[0] for _ in it[0]]
        assert t == pytest.approx(d, rel=1e-5, abs=1e-4)
        assert f == pytest.approx(d, rel=1e-5, abs=1e-4)
        assert t == pytest.approx(a, rel=1e-6, abs=1e-5)  # the batch a row lands in does not matter


def test_tokenizer_vocab_refused(tmp_path):
    from datapipe.tokenize import train_bpe
    from train.eval.evaluator import check_tokenizer

    path = train_bpe(["hello world " * 50, "other text here"] * 20, 300, "<|endoftext|>", str(tmp_path / "t.json"))
    assert check_tokenizer(path, 1024) <= 300
    with pytest.raises(ConfigError, match=r"has \d+ tokens but the model's vocabulary has 100"):
        check_tokenizer(path, 100)
