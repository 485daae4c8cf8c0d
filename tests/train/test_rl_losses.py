"""RL loss forms (train.objectives.rl_losses) against the peers: TRL 1.16 GRPOTrainer's `_compute_loss` on
the same per-token log-probs, entropies, advantages and masks (loss and gradient within 1e-6, for every
loss type we support, with and without the KL term and the entropy bonus, on-policy and with old log-probs
that differ so that clipping acts), TRL's RewardTrainer loss (margin, centring), and float64 references
written here from the formulas for group advantages, RLOO, GAE and PPO's clipped value loss."""
from __future__ import annotations

import types
import zlib
from collections import defaultdict

import pytest
import torch

from testutil import require, run_gloo_workers, write_gathered
from train.objectives import rl_losses as L

trl = require("trl")  # a dev dependency: missing under CI is a failure, not a skip


def _trl_grpo_loss(logp, old_logp, ref_logp, entropies, adv, mask, *, loss_type, beta, eps_low, eps_high,
                   entropy_coef, max_len):
    """TRL's own GRPOTrainer._compute_loss on a stand-in trainer object (one process, no accumulation)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    acc = types.SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x, reduce=lambda x, **k: x,
                                gather_for_metrics=lambda x: x)
    fake = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_len, accelerator=acc,
        _entropy_bonus_enabled=entropy_coef != 0.0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _metrics={"train": defaultdict(list)}, aux_loss_enabled=False,
        args=types.SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=1))
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropies, None)
    B, T = mask.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "num_items_in_batch": mask.sum()}
    if old_logp is not None:
        inputs["old_per_token_logps"] = old_logp
    if beta:
        inputs["ref_per_token_logps"] = ref_logp
    return GRPOTrainer._compute_loss(fake, None, inputs)


def _ours(logp, old_logp, ref_logp, entropies, adv, mask, *, loss_type, beta, eps_low, eps_high, entropy_coef,
          max_len, split=(2, 3, 3)):
    """The loss formulas (policy_loss, token_weights) combined over micro-batches of `split` rows, with old
    log-probs that differ so that clipping acts (the trainer's own combination, on policy, at DP=2:
    test_the_trainers_loss_at_dp2_equals_trl_on_the_whole_batch)."""
    old = logp.detach() if old_logp is None else old_logp
    tokens, seqs = int(mask.sum()), mask.shape[0]
    total, start = 0.0, 0
    for n in split:
        sl = slice(start, start + n)
        start += n
        per_tok, _ = L.policy_loss(logp[sl], old[sl], adv[sl].unsqueeze(1), eps_low=eps_low, eps_high=eps_high,
                                   ref_logp=ref_logp[sl], kl_coef=beta, kl="k3")
        w = L.token_weights(mask[sl], loss_type, sequences=seqs, tokens=tokens, max_completion_length=max_len,
                            micro_batches=len(split))
        total = total + (w * per_tok).sum() - entropy_coef * (entropies[sl] * mask[sl]).sum() / tokens
    return total


@pytest.mark.parametrize("loss_type", L.LOSS_TYPES)
@pytest.mark.parametrize("beta,entropy_coef,off_policy", [(0.0, 0.0, False), (0.04, 0.0, True), (0.1, 0.01, True)])
def test_grpo_loss_and_gradient_equal_trl(loss_type, beta, entropy_coef, off_policy):
    g = torch.Generator().manual_seed(zlib.crc32(repr((loss_type, beta, off_policy)).encode()))  # same in every process
    B, T = 8, 7
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[:, 0] = 1
    base = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = base + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64) if off_policy else None
    ref = base + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    if loss_type == "bnpo":  # TRL's bnpo is one micro-batch's token mean: compare on one micro-batch
        split = (B,)
    else:
        split = (2, 3, 3)
    kw = dict(loss_type=loss_type, beta=beta, eps_low=0.2, eps_high=0.28, entropy_coef=entropy_coef, max_len=10)
    lp_trl = base.clone().requires_grad_(True)
    lp_ours = base.clone().requires_grad_(True)
    want = _trl_grpo_loss(lp_trl, old, ref, ent, adv, mask, **kw)
    got = _ours(lp_ours, old, ref, ent, adv, mask, split=split, **kw)
    want.backward()
    got.backward()
    assert float(got) == pytest.approx(float(want), abs=1e-6)
    assert torch.allclose(lp_ours.grad, lp_trl.grad, atol=1e-6), (lp_ours.grad - lp_trl.grad).abs().max()
    if off_policy:  # clipping acted: some gradients are zeroed on both sides
        _, st = L.policy_loss(base, old, adv.unsqueeze(1), eps_low=0.2, eps_high=0.28)
        assert bool((st["clipped"] & mask.bool()).any())


def _case(loss_type, beta, entropy_coef, B=8, T=7, V=11):
    """A step's rows (rollout.F layout) and the policy's logits at every position, the same in every process."""
    from train.objectives.rollout import F, FIELDS

    g = torch.Generator().manual_seed(zlib.crc32(repr((loss_type, beta, entropy_coef)).encode()))
    rows = torch.zeros(B, len(FIELDS), T, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 1
    rows[:, F["mask"]] = mask
    rows[:, F["labels"]] = torch.randint(0, V, (B, T), generator=g).double()
    rows[:, F["advantage"]] = torch.randn(B, 1, generator=g, dtype=torch.float64)
    rows[:, F["ref_logp"]] = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logits = torch.randn(B, T, V, generator=g) * 2
    return rows, logits


CASES = [(t, beta, ent) for t in L.LOSS_TYPES for beta, ent in ((0.0, 0.0), (0.04, 0.02)) if t != "bnpo" or not ent]


def _dp_worker(out: str) -> None:
    """Rank r of 2 (DP=2, gloo): the trainer's own path on its half of the rows, micro-batches of 2 rows (bnpo:
    one of 4): rollout.set_weights (global counts by all-reduce), RL.loss per micro-batch, the sum divided by
    the step's global count of the counts RL.loss returns, as megatron divides per-token losses."""

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from train.objectives import rollout
    from train.objectives.rl import RL

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(1, 1)
    r, res = dist.get_rank(), {}
    for loss_type, beta, ent in CASES:
        rows, logits = _case(loss_type, beta, ent)
        half = rows.shape[0] // 2
        rows, logits = rows[r * half:(r + 1) * half].clone(), logits[r * half:(r + 1) * half].clone()
        logits.requires_grad_(True)
        obj = object.__new__(RL)
        obj.rl = types.SimpleNamespace(loss_type=loss_type, kl_coef=beta, entropy_coef=ent, kl="k3",
                                       kl_bias_correction=True, eps_low=0.2, eps_high=0.28, temperature=1.0)
        obj.vocab = logits.shape[-1]
        per_micro = half if loss_type == "bnpo" else 2
        obj.tokens = rollout.set_weights(rows, loss_type, per_micro, 10, "cpu")["tokens"]
        total, n = 0.0, torch.zeros((), dtype=torch.float64)
        for m in range(0, half, per_micro):
            t, count, _ = obj.loss(logits[m:m + per_micro], rows[m:m + per_micro])
            total, n = total + t, n + count
        dist.all_reduce(n)  # megatron: the per-token loss's count over micro-batches and DP ranks
        (total / n).backward()
        res[f"{loss_type}/{beta}/{ent}/{r}"] = {"loss": float(total / n), "grad": logits.grad.tolist()}
    write_gathered(res, out)


def test_the_trainers_loss_at_dp2_equals_trl_on_the_whole_batch(tmp_path):
    """What RL.loss and rollout.set_weights give on two DP ranks equals TRL's GRPOTrainer loss and gradient on
    the whole step (bnpo: TRL's per-process token means averaged over the two processes, as DDP does): the
    weights' global counts, the `tokens ×` scaling and the entropy bonus over the global count all matter."""

    from train.objectives.rollout import F

    res = run_gloo_workers(__file__, "_dp_worker", tmp_path / "dp.json")
    for loss_type, beta, ent in CASES:
        rows, logits = _case(loss_type, beta, ent)
        lg = logits.double().requires_grad_(True)
        logp_all = torch.log_softmax(lg, -1)
        logp = logp_all.gather(-1, rows[:, F["labels"]].long().unsqueeze(-1)).squeeze(-1)
        entropies = -(logp_all.exp() * logp_all).sum(-1)
        mask, adv, ref = rows[:, F["mask"]].long(), rows[:, F["advantage"], 0], rows[:, F["ref_logp"]]
        kw = dict(loss_type=loss_type, beta=beta, eps_low=0.2, eps_high=0.28, entropy_coef=ent, max_len=10)
        if loss_type == "bnpo":  # one micro-batch per process, DDP's mean of the two
            h = rows.shape[0] // 2
            want = sum(_trl_grpo_loss(logp[s], None, ref[s], entropies[s], adv[s], mask[s], **kw)
                       for s in (slice(0, h), slice(h, None))) / 2
        else:
            want = _trl_grpo_loss(logp, None, ref, entropies, adv, mask, **kw)
        want.backward()
        got = [res[f"{loss_type}/{beta}/{ent}/{r}"] for r in (0, 1)]
        assert got[0]["loss"] + got[1]["loss"] == pytest.approx(float(want), abs=1e-5), (loss_type, beta, ent)
        grad = torch.tensor(got[0]["grad"] + got[1]["grad"], dtype=torch.float64)
        assert torch.allclose(grad, lg.grad, atol=1e-6), (loss_type, beta, ent, (grad - lg.grad).abs().max())


def test_reward_model_loss_equals_trl():
    from trl.trainer.reward_trainer import RewardTrainer

    g = torch.Generator().manual_seed(3)
    c, r, m = (torch.randn(6, generator=g, dtype=torch.float64) for _ in range(3))
    for margin, center in ((None, None), (m, None), (m, 0.01)):
        logits = torch.cat([c, r]).unsqueeze(-1)
        fake = types.SimpleNamespace(model=types.SimpleNamespace(training=False), _metrics={"eval": defaultdict(list)},
                                     args=types.SimpleNamespace(center_rewards_coefficient=center),
                                     accelerator=types.SimpleNamespace(gather=lambda x: x,
                                                                       gather_for_metrics=lambda x: x),
                                     _total_train_tokens=0, _tp_size=1)
        inputs = {"attention_mask": torch.ones(12, 3)} | ({"margin": margin} if margin is not None else {})
        want = RewardTrainer.compute_loss(fake, lambda **k: types.SimpleNamespace(logits=logits), inputs)
        got = L.reward_model_loss(c, r, margin, center or 0.0).mean()
        assert float(got) == pytest.approx(float(want), abs=1e-9)


def test_group_advantages_and_rloo_follow_the_formulas():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0], dtype=torch.float64)
    G = 4
    want = []
    for k in range(2):
        g = r[k * G:(k + 1) * G].tolist()
        mean = sum(g) / G
        std = (sum((x - mean) ** 2 for x in g) / (G - 1)) ** 0.5  # unbiased, as torch.std and TRL
        want += [(x - mean) / (std + 1e-4) for x in g]
    assert torch.allclose(L.group_advantages(r, G), torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(L.group_advantages(r, G, scale=False), r - r.reshape(2, 4).mean(1).repeat_interleave(4))
    loo = [x - (sum(r[k * G:(k + 1) * G].tolist()) - x) / (G - 1) for k in range(2) for x in r[k * G:(k + 1) * G].tolist()]
    assert torch.allclose(L.group_advantages(r, G, estimator="rloo"), torch.tensor(loo, dtype=torch.float64))


def test_gae_and_clipped_value_loss_follow_the_formulas():
    g = torch.Generator().manual_seed(5)
    B, T, gamma, lam = 3, 6, 0.99, 0.95
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    adv, ret = L.gae(rewards, values, mask, gamma, lam)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        a_next = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            v_next = values[b, idx[j + 1]].item() if j + 1 < len(idx) else 0.0
            delta = rewards[b, t].item() + gamma * v_next - values[b, t].item()
            a_next = delta + gamma * lam * a_next
            assert adv[b, t].item() == pytest.approx(a_next, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(a_next + values[b, t].item(), abs=1e-12)
        assert all(adv[b, t] == 0 and ret[b, t] == 0 for t in range(T) if not mask[b, t])
    old = values + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    vl = L.value_loss(values, old, ret, 0.2)
    for b in range(B):
        for t in range(T):
            v, o, R = values[b, t].item(), old[b, t].item(), ret[b, t].item()
            c = o + min(max(v - o, -0.2), 0.2)
            assert vl[b, t].item() == pytest.approx(0.5 * max((v - R) ** 2, (c - R) ** 2), abs=1e-12)
    # PPO's clipped objective from the formula, per token
    logp, oldp = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    pl, _ = L.policy_loss(logp, oldp, adv, eps_low=0.2, eps_high=0.2)
    for b in range(B):
        for t in range(T):
            rho, a = torch.exp(logp[b, t] - oldp[b, t]).item(), adv[b, t].item()
            assert pl[b, t].item() == pytest.approx(max(-a * rho, -a * min(max(rho, 0.8), 1.2)), abs=1e-12)


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref
    assert torch.allclose(L.kl_estimate(lp, ref, "k1"), d)
    assert torch.allclose(L.kl_estimate(lp, ref, "k2"), 0.5 * d ** 2)
    assert torch.allclose(L.kl_estimate(lp, ref, "k3"), torch.exp(ref - lp) - (ref - lp) - 1)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        L.kl_estimate(lp, ref, "k4")
