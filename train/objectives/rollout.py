"""RL rollouts: the step's prompts → G completions each from the generation engine (on rank 0, on a
transformers mirror of the policy's current weights) → rewards → advantages → the rows the trainer trains
on, with every rank's share.

Rows are float64 [rows, FIELDS, width] (token ids are exact in float64): tokens, next-token labels, the
loss mask (completion tokens), the per-token loss weight (train.objectives.rl_losses.token_weights),
the advantage, the reference log-prob (filled on the last pipeline stage when kl_coef > 0), the
engine's log-prob of each sampled token (for the engine/trainer mismatch metric), and PPO's returns and
old values (per token, last stage).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from train.objectives import rl_losses as L

FIELDS = ("tokens", "labels", "mask", "weight", "advantage", "ref_logp", "engine_logp", "returns", "old_values")
F = {name: i for i, name in enumerate(FIELDS)}


@dataclass
class Rollout:
    """One step's completions, in prompt order, G per prompt (built on rank 0, broadcast to every rank)."""
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    engine_logps: list[list[float]]
    rewards: list[float]
    parts: list[list[float]]          # each reward function's raw values
    advantages: list[float]
    lengths: list[int]
    truncated: list[bool]


def generate(engine, tokenizer, prompts: list, cfg, seed: int, rewards, estimator: str) -> Rollout:
    """G sampled completions per prompt, their rewards (texts decoded without special tokens, cut at a stop
    string) and group advantages (GRPO/RLOO; PPO's come later, per token)."""
    from train.generation.engine import SamplingParams
    from train.objectives import rewards as R

    rl = cfg.rl
    params = SamplingParams(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p,
                            n=rl.group_size, seed=seed, stop=tuple(rl.stop), logprobs=True)
    out = engine.generate([p.ids for p in prompts], params)
    prompt_ids, comp, lps, texts, answers, prompt_texts, truncated = [], [], [], [], [], [], []
    for p, group in zip(prompts, out, strict=True):
        ptext = tokenizer.decode(p.ids, skip_special_tokens=True)
        for c in group:
            prompt_ids.append(p.ids)
            comp.append(c.token_ids)
            lps.append(c.logprobs or [0.0] * len(c.token_ids))
            texts.append(cut(tokenizer.decode(c.token_ids, skip_special_tokens=True), rl.stop))
            answers.append(p.answer)
            prompt_texts.append(ptext)
            truncated.append(c.finish_reason == "length")
    total, parts = R.total(rewards, prompt_texts, texts, answers, rl.reward_clip)
    r = torch.tensor(total, dtype=torch.float64)
    if rl.whiten_rewards:
        r = L.whiten(r)
    if estimator == "ppo":
        adv = r  # per-token advantages come from GAE in the trainer; here the sequence reward
    else:
        adv = L.group_advantages(r, rl.group_size, estimator=estimator, scale=rl.scale_rewards)
        if rl.whiten_advantages:
            adv = L.whiten(adv)
    return Rollout(prompt_ids, comp, lps, total, parts, adv.tolist(), [len(c) for c in comp], truncated)


def cut(text: str, stops) -> str:
    for s in stops:
        text = text.split(s)[0]
    return text


def share(rollout: Rollout | None, src: int = 0) -> Rollout:
    box = [rollout]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rows(rollout: Rollout, sl: slice, seq_len: int) -> tuple[torch.Tensor, int]:
    """This rank's rows (completions `sl`) and their width (longest prompt + completion, a multiple of 8);
    sequences are cut to seq_len + 1 tokens (the completion's tail is lost, and counted as truncated)."""
    seqs = [(p + c)[: seq_len + 1] for p, c in zip(rollout.prompt_ids[sl], rollout.completion_ids[sl], strict=True)]
    width = min(seq_len, -(-max(len(s) - 1 for s in seqs) // 8) * 8)
    out = torch.zeros(len(seqs), len(FIELDS), width, dtype=torch.float64)
    for i, (s, p, lp, a) in enumerate(zip(seqs, rollout.prompt_ids[sl], rollout.engine_logps[sl],
                                          rollout.advantages[sl], strict=True)):
        n = len(s) - 1
        out[i, F["tokens"], :n] = torch.tensor(s[:-1], dtype=torch.float64)
        out[i, F["labels"], :n] = torch.tensor(s[1:], dtype=torch.float64)
        start = len(p) - 1  # the position that predicts the first completion token
        if n > start:
            out[i, F["mask"], start:n] = 1.0
            out[i, F["engine_logp"], start:n] = torch.tensor(lp[: n - start], dtype=torch.float64)
        out[i, F["advantage"], :] = a
    return out, width


def set_weights(batch: torch.Tensor, loss_type: str, rows_per_micro: int, max_new_tokens: int, device) -> dict:
    """Fill the loss weights from the step's global counts (all DP ranks: an all-reduce); returns them."""
    mask = batch[:, F["mask"]]
    local = torch.tensor([float(mask.sum()), float(batch.shape[0]), float(-(-batch.shape[0] // rows_per_micro))],
                         dtype=torch.float64, device=device)
    from megatron.core import parallel_state as ps

    dist.all_reduce(local, group=ps.get_data_parallel_group())
    tokens, seqs, micro = (int(x) for x in local.tolist())
    for start in range(0, batch.shape[0], rows_per_micro):
        sl = slice(start, start + rows_per_micro)
        batch[sl, F["weight"]] = L.token_weights(mask[sl], loss_type, sequences=seqs, tokens=tokens,
                                                 max_completion_length=max_new_tokens, micro_batches=micro)
    return {"tokens": tokens, "sequences": seqs, "micro_batches": micro}
