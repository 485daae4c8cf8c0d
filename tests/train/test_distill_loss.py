"""Distillation losses (train.objectives.distill_loss) against TRL 1.16's GKDTrainer.generalized_jsd_loss on
the same logits (value and gradient), over the whole vocabulary and over the teacher's top k; and the
tensor-parallel path (2 gloo ranks, the vocabulary split) against the single-rank one."""
from __future__ import annotations


import pytest
import torch

from testutil import require, run_gloo_workers, write_gathered
from train.objectives import distill_loss as DL

B, S, V, VOCAB = 2, 5, 48, 45  # 3 padding rows past the vocabulary, as a padded embedding has


def _logits(seed: int):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(B, S, V, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    labels[0, :2] = -100
    return s, t, labels


def _trl(s, t, labels, beta, temperature):
    require("trl")  # a dev dependency: missing under CI is a failure, not a skip
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=temperature)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_full_vocabulary_equals_trl(beta, temperature):
    s, t, labels = _logits(1)
    ref = _trl(s[..., :VOCAB], t[..., :VOCAB], labels, beta, temperature)  # TRL sees the real vocabulary
    (g_ref,) = torch.autograd.grad(ref, s)
    mask = (labels != -100).double()
    ours = (DL.full_vocab(s, t, beta=beta, temperature=temperature, vocab=VOCAB) * mask).sum() / mask.sum()
    (g,) = torch.autograd.grad(ours, s)
    assert abs(float(ours.detach()) - float(ref)) < 1e-6 * max(1.0, abs(float(ref)))
    assert torch.allclose(g.double(), g_ref, atol=1e-7, rtol=1e-5)
    assert float(g[..., VOCAB:].abs().max()) == 0.0  # padding rows take no part


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_equals_trl_on_the_teachers_top_k(beta):
    s, t, labels = _logits(2)
    k, T = 7, 2.0
    values, ids = DL.teacher_top_k(t, k, VOCAB)
    assert int(ids.max()) < VOCAB and torch.equal(values, t[..., :VOCAB].topk(k, -1).values.float())
    ref = _trl(s.gather(-1, ids), values.double(), labels, beta, T)
    (g_ref,) = torch.autograd.grad(ref, s)
    mask = (labels != -100).double()
    ours = (DL.top_k(s, values, ids, beta=beta, temperature=T) * mask).sum() / mask.sum()
    (g,) = torch.autograd.grad(ours, s)
    assert abs(float(ours.detach()) - float(ref)) < 1e-6 * max(1.0, abs(float(ref)))
    assert torch.allclose(g.double(), g_ref, atol=1e-7, rtol=1e-5)


def test_top_k_of_the_whole_vocabulary_is_the_full_loss():
    s, t, _ = _logits(3)
    v, i = DL.teacher_top_k(t, VOCAB, VOCAB)
    a = DL.top_k(s, v, i, beta=0.5, temperature=1.5)
    b = DL.full_vocab(s, t, beta=0.5, temperature=1.5, vocab=VOCAB)
    assert torch.allclose(a, b, atol=1e-5)


def _tp_worker(out: str) -> None:
    """Run by 2 gloo ranks: this rank's vocabulary half; losses summed per token, gradients of its half."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from train.model import cpu_compat

    cpu_compat.install()
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    r = dist.get_rank()
    s, t, labels = _logits(4)
    half = V // 2
    res = {}
    for name in ("full", "topk", "ce"):
        for beta in (0.0, 0.5, 1.0):
            mine = s.detach()[..., r * half:(r + 1) * half].float().clone().requires_grad_()
            tt = t[..., r * half:(r + 1) * half].float()
            if name == "full":
                per = DL.full_vocab(mine, tt, beta=beta, temperature=2.0, vocab=VOCAB)
            elif name == "topk":
                per = DL.top_k(mine, *DL.teacher_top_k(tt, 6, VOCAB), beta=beta, temperature=2.0)
            else:
                per = DL.ce_tp(mine, labels.clamp(min=0))
            (per * torch.arange(1, S + 1)).sum().backward()  # a weight per position: gradients must carry it
            res[f"{name}/{beta}/{r}"] = {"loss": per.tolist(), "grad": mine.grad.tolist()}
    write_gathered(res, out)


def test_tensor_parallel_equals_one_rank(tmp_path):
    res = run_gloo_workers(__file__, "_tp_worker", tmp_path / "tp.json", timeout=120)
    s, t, labels = _logits(4)
    w = torch.arange(1, S + 1)
    for beta in (0.0, 0.5, 1.0):
        for name in ("full", "topk", "ce"):
            x = s.detach().float().clone().requires_grad_()
            if name == "full":
                per = DL.full_vocab(x, t.float(), beta=beta, temperature=2.0, vocab=VOCAB)
            elif name == "topk":
                per = DL.top_k(x, *DL.teacher_top_k(t.float(), 6, VOCAB), beta=beta, temperature=2.0)
            else:
                per = torch.nn.functional.cross_entropy(x.reshape(-1, V), labels.clamp(min=0).reshape(-1),
                                                        reduction="none").reshape(B, S)
            (per * w).sum().backward()
            for rank in (0, 1):
                got = res[f"{name}/{beta}/{rank}"]
                assert torch.allclose(torch.tensor(got["loss"]), per.detach(), atol=1e-5), (name, beta, rank)
                half = x.grad[..., rank * (V // 2):(rank + 1) * (V // 2)]
                assert torch.allclose(torch.tensor(got["grad"]), half, atol=1e-5), (name, beta, rank)
