"""Online RL on the trainer: `objective: grpo | rloo | ppo`, one loop (the `rl:` section, rl_config.py).

Each step: the step's prompts (storage's PromptLoader, a DP-independent order) are gathered, the policy's
current weights are mirrored into a transformers model on rank 0 (train.generation.sync), the engine
samples `group_size` completions per prompt, the rewards (rewards.py) are computed and clipped, and
advantages are formed (GRPO: group-normalised; RLOO: leave-one-out; PPO: GAE over per-token rewards with
the value head, ppo.py). Every rank takes its rows (rollout.py); the Megatron model recomputes the
log-probs of the sampled tokens (the trainer's numbers are the truth; their mean absolute difference from
the engine's is logged as `logp_mismatch`) and the clipped policy loss with the KL to a frozen reference
and the entropy bonus is weighted per token so that the step's loss is TRL's for the chosen loss_type
(rl_losses.py). One optimizer step per generation batch: the old log-probs are the current ones, detached.

The rollouts of step k depend on the weights, the step's prompts and a seed from (seed, k): a resumed run
generates the same completions, so kill -9 and resume is bit-identical to an uninterrupted run.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from storage.config import ConfigError
from train.objectives import rl_losses as L
from train.objectives.base import Objective
from train.objectives.rollout import F

METRICS = ("kl", "entropy", "clipped", "logp_mismatch", "value_loss")


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) whose last dimension is split over the tensor-parallel ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    m = logits.detach().max(-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - m
    e = z.exp()
    s = reduce(e.sum(-1))
    return s.log() - reduce((e * z).sum(-1)) / s


def token_logps(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, vocab: int, temperature: float,
                entropy_grad: bool = True):
    """(log-probs of `labels`, entropies) [B, S] under softmax(logits / temperature), TP-split vocabulary, at
    the positions where `mask` is set, 0 elsewhere (only completion tokens enter the loss). `logits` are
    [B, S, V] or, from a model asked for the mask's positions only (`policy_forward`), [1, N, V]. The
    embedding's padding rows (ids >= vocab) are excluded, as the engine never samples them. With
    entropy_grad False the entropy is a detached metric (no autograd graph kept for it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    at = mask.bool()
    z = (logits[at] if logits.shape[:2] == at.shape else logits.reshape(-1, logits.shape[-1])).float()
    if temperature != 1.0:
        z = z / temperature
    part = z.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * part
    if start + part > vocab:
        keep = max(vocab - start, 0)
        z = torch.cat([z[:, :keep], torch.full_like(z[:, keep:], -1e30)], -1)
    logp = -vocab_parallel_cross_entropy(z.clone(), labels[at])  # (it subtracts the max in place)
    if entropy_grad:
        ent = vocab_parallel_entropy(z)
    else:
        with torch.no_grad():
            ent = vocab_parallel_entropy(z.detach())
    full = torch.zeros(labels.shape, dtype=logp.dtype, device=logp.device)
    return full.masked_scatter(at, logp), full.masked_scatter(at, ent)


class RL(Objective):
    data = "prompts"
    report_fields = METRICS
    estimator = "grpo"

    @classmethod
    def validate(cls, cfg) -> None:
        cfg.rl.check(cls.name)
        if cfg.data.document_masking:
            raise ConfigError(f"key 'data.document_masking': {cls.name} trains on one completion per row")

    @classmethod
    def extend_model(cls, cfg, chunks: list) -> None:
        from train.model.heads import logits_at_positions

        for c in chunks:
            logits_at_positions(c)

    @classmethod
    def check_data(cls, cfg) -> None:
        from storage.loader.prompts import iter_prompts
        from train.objectives.rewards import NEED_ANSWER

        if cfg.rl.kl_coef and not (cfg.rl.reference or cfg.init):
            raise ConfigError("key 'rl.reference': a KL penalty (rl.kl_coef > 0) needs a reference model: set it, or "
                              "start from one with --init, which is then the reference")
        need = [i for i, r in enumerate(cfg.rl.rewards) if r.name in NEED_ANSWER]
        if need:
            for n, p in enumerate(iter_prompts(cfg.data.dataset, "train")):
                if p.answer is None:
                    raise ConfigError(f"key 'rl.rewards.{need[0]}.name': reward {cfg.rl.rewards[need[0]].name!r} needs "
                                      f"an answer, and prompt {p.doc_id!r} of {cfg.data.dataset} has none (a `format: "
                                      "prompts` source's `answer` field)")
                if n >= 1000:
                    break

    def __init__(self, cfg, par, model: list, sinks):
        super().__init__(cfg, par, model, sinks)
        from train.generation.sync import HFMirror
        from train.objectives import rewards as R

        self.rl = cfg.rl
        self.mirror = HFMirror(cfg.model)
        self.rewards = R.build(cfg.rl.rewards)
        # ids the tokenizer has: the engine never samples the embedding's rows past them, nor may log-probs count them
        from tokenizers import Tokenizer

        from storage.fs import read_bytes

        self.vocab = Tokenizer.from_str(read_bytes(self._tokenizer_path()).decode()).get_vocab_size(
            with_added_tokens=True)
        self.rollouts = 0          # generation batches done (seeds the sampling; checkpointed)
        self.tokens = 0            # completion tokens of the current step (all DP ranks)
        self.stats: dict = {}
        self.engine = self.tokenizer = None
        self.reference = None
        if cfg.rl.kl_coef:
            from train.objectives.refs import OnlineReference

            self.reference = OnlineReference(cfg, par, cfg.rl.reference or cfg.init)
            self.extend_model(cfg, _unwrapped(self.reference.chunks))

    def rows_per_micro(self) -> int:
        return self.cfg.parallel.micro_batch_size * self.rl.group_size

    def sequences(self, global_batch: int) -> int:
        return global_batch * self.rl.group_size

    def prepare(self, step: int) -> None:
        """At the start of a run (not a resume), the starting policy's held-out reward: the baseline the
        in-loop evaluations compare with (logged as the evaluation of step 0)."""
        if step == 0 and self.cfg.eval.every and self.rl.eval_prompts:
            self.sinks.log_eval(0, 0, {**self.evaluate(), "eval_time_s": 0.0})

    def state_dict(self) -> dict:
        return {"rollouts": self.rollouts}

    def load_state_dict(self, sd: dict) -> None:
        self.rollouts = int(sd.get("rollouts", 0))

    # ---------------------------------------------------------------- rollouts
    def _engine(self, model):
        if self.engine is None:
            from train.generation.chat import end_of_turn_ids
            from train.generation.engine import Engine
            from train.generation.load import tokenizer_for

            self.tokenizer, template, eos = tokenizer_for(self._tokenizer_path())
            stop = list(eos) + [i for i in end_of_turn_ids(template or _chatml(), self.tokenizer) if i not in eos]
            self.engine = Engine(model, self.tokenizer, stop, backend=self.rl.backend,
                                 max_batch_size=min(max(self.sequences(self.cfg.parallel.global_batch_size), 16), 256))
        return self.engine

    def _tokenizer_path(self) -> str:
        from storage import fs
        from storage.manifest import read_manifest

        return fs.join(self.cfg.data.dataset, read_manifest(self.cfg.data.dataset).tokenizer.file)

    def before_step(self, prompts: list) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        from train.objectives import rollout

        t0 = time.perf_counter()
        groups = [None] * self.par.dp
        dist.all_gather_object(groups, prompts, group=ps.get_data_parallel_group())
        everyone = [p for g in groups for p in g]
        model = self.mirror.sync(self.model)
        t_sync = time.perf_counter()
        ro = None
        if self.par.rank == 0:
            ro = rollout.generate(self._engine(model), self.tokenizer, everyone, self.cfg,
                                  seed=self.cfg.seed * 1_000_003 + self.rollouts, rewards=self.rewards,
                                  estimator=self.estimator)
        ro = rollout.share(ro)
        t_gen = time.perf_counter()
        self.rollouts += 1
        G, local = self.rl.group_size, len(prompts)
        start = sum(len(g) for g in groups[:self.par.dp_rank]) * G
        rows, _ = rollout.rows(ro, slice(start, start + local * G), self.cfg.data.seq_len)
        rows = rows.to(self.par.device)
        if self.reference is not None:
            ref = self.reference_logps(rows)
            if ref is not None:
                rows[:, F["ref_logp"]] = ref
        counts = rollout.set_weights(rows, self.rl.loss_type, self.rows_per_micro(), self.rl.max_new_tokens,
                                     self.par.device)
        self.tokens = counts["tokens"]
        r = torch.tensor(ro.rewards, dtype=torch.float64)
        self.stats = {"reward": float(r.mean()), "reward_std": float(r.std()) if len(r) > 1 else 0.0,
                      "response_length": sum(ro.lengths) / len(ro.lengths),
                      "truncated": sum(ro.truncated) / len(ro.truncated),
                      "sync_s": t_sync - t0, "generation_s": t_gen - t_sync, "rollout_s": time.perf_counter() - t0}
        for (w, fn), part in zip(self.rewards, ro.parts, strict=True):
            self.stats[f"reward/{getattr(fn, '__name__', type(fn).__name__)}"] = sum(part) / len(part)
        return rows

    def reference_logps(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Per-token log-probs of the labels under the frozen reference (last pipeline stage; else None)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro = list(rows.split(self.rows_per_micro()))

        def forward_step(data_iterator, model):
            r = next(data_iterator)
            out = self.policy_forward(model, r)

            def collect(logits):
                lp, _ = token_logps(logits, r[:, F["labels"]].long(), r[:, F["mask"]], self.vocab,
                                    self.rl.temperature, entropy_grad=False)
                return lp.sum(), torch.tensor(1, dtype=torch.int, device=lp.device), {"lp": lp.detach()}
            return out, collect

        with torch.no_grad():
            stores = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=self.reference.chunks,
                num_microbatches=len(micro), seq_length=rows.shape[-1], micro_batch_size=self.rows_per_micro(),
                forward_only=True)
        if not self.par.is_last_stage:
            return None
        return torch.cat([s["lp"] for s in stores]).double()

    # ---------------------------------------------------------------- loss
    def forward(self, model, rows, docs: dict, rope: dict):
        return self.policy_forward(model, rows), lambda logits: self.loss(logits, rows)

    @staticmethod
    def policy_forward(model, rows: torch.Tensor):
        """The model on the rows' tokens; on the last stage it returns logits at the completion positions only."""
        tokens = rows[:, F["tokens"]].long()
        (chunk,) = _unwrapped([model])
        if getattr(chunk, "post_process", False):
            chunk.logit_positions = rows[:, F["mask"]].bool()
        return model(tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), None)

    def loss(self, logits: torch.Tensor, rows: torch.Tensor, kl_in_loss: bool = True):
        rl = self.rl
        mask = rows[:, F["mask"]].float()
        logp, ent = token_logps(logits, rows[:, F["labels"]].long(), mask, self.vocab, rl.temperature,
                                entropy_grad=bool(rl.entropy_coef))
        adv = rows[:, F["advantage"]].float()
        per_tok, st = L.policy_loss(logp, logp.detach(), adv, eps_low=rl.eps_low, eps_high=rl.eps_high,
                                    ref_logp=rows[:, F["ref_logp"]].float(), kl_coef=rl.kl_coef if kl_in_loss else 0.0,
                                    kl=rl.kl, bias_correction=rl.kl_bias_correction)
        if not kl_in_loss and rl.kl_coef:  # PPO: the KL is in the rewards; still reported
            st["kl"] = L.kl_estimate(logp.detach(), rows[:, F["ref_logp"]].float(), rl.kl)
        w = rows[:, F["weight"]].float()
        total = self.tokens * (w * per_tok).sum()
        if rl.entropy_coef:
            total = total - rl.entropy_coef * (ent * mask).sum()
        n = mask.sum()
        with torch.no_grad():
            kl = (st["kl"] * mask).sum() if "kl" in st else torch.zeros((), device=n.device)
            mism = ((logp - rows[:, F["engine_logp"]].float()).abs() * mask).sum()
            extra = [kl, (ent * mask).sum(), (st["clipped"].float() * mask).sum(), mism, torch.zeros_like(n)]
        report = torch.stack([total.detach().double(), n.double(), n.double(), *(x.double() for x in extra)])
        return total, n.to(torch.int), report

    def record(self, report) -> dict:
        n = float(report[1])
        out = dict(self.stats)
        if n:
            out |= {k: float(report[3 + i]) / n for i, k in enumerate(METRICS) if k != "value_loss"}
            out["clip_fraction"] = out.pop("clipped")
        return out

    def log_fields(self, window: list[dict], tokens: int, elapsed: float) -> dict:
        keys = [k for k in window[-1] if k.startswith(("reward", "response_length", "truncated", "kl", "entropy",
                                                       "clip_fraction", "logp_mismatch", "value_loss", "sync_s", "generation_s",
                                                       "rollout_s"))]
        out = {k: sum(w[k] for w in window) / len(window) for k in keys}
        out["update_s"] = sum(w["step_time_s"] - w.get("rollout_s", 0.0) for w in window) / len(window)
        out["row_width"] = sum(w["width"] for w in window) / len(window)  # rows are cut after the longest
        out["completion_tokens_per_s"] = sum(w["loss_tokens"] for w in window) / elapsed if elapsed > 0 else 0.0
        return out

    # ---------------------------------------------------------------- held-out reward
    def evaluate(self) -> dict:
        """Greedy completions of the held-out prompts (the first rl.eval_prompts): mean reward and its
        standard error, with the model as it is now."""
        if not self.rl.eval_prompts:
            return {}
        from storage.loader.prompts import iter_prompts
        from train.generation.engine import SamplingParams
        from train.objectives import rewards as R
        from train.objectives.rollout import cut

        prompts = []
        for p in iter_prompts(self.cfg.data.dataset, "validation"):
            prompts.append(p)
            if len(prompts) == self.rl.eval_prompts:
                break
        if not prompts:
            return {}
        model = self.mirror.sync(self.model)
        out = None
        if self.par.rank == 0:
            eng = self._engine(model)
            res = eng.generate([p.ids for p in prompts], SamplingParams(max_new_tokens=self.rl.max_new_tokens,
                                                                        stop=tuple(self.rl.stop)))
            texts = [cut(self.tokenizer.decode(c[0].token_ids, skip_special_tokens=True), self.rl.stop) for c in res]
            ptexts = [self.tokenizer.decode(p.ids, skip_special_tokens=True) for p in prompts]
            r, _ = R.total(self.rewards, ptexts, texts, [p.answer for p in prompts], self.rl.reward_clip)
            mean = sum(r) / len(r)
            se = math.sqrt(sum((x - mean) ** 2 for x in r) / max(len(r) - 1, 1) / len(r))
            out = {"rl_val/reward": mean, "rl_val/reward_se": se, "rl_val/prompts": len(r),
                   "rl_val/response_length": sum(len(c[0].token_ids) for c in res) / len(res)}
        box = [out]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _unwrapped(chunks: list) -> list:
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunks)


def _chatml() -> str:
    from storage.chat import BUILTIN_TEMPLATES

    return BUILTIN_TEMPLATES["chatml"]


class GRPO(RL):
    name = "grpo"
    estimator = "grpo"


class RLOO(RL):
    name = "rloo"
    estimator = "rloo"
