"""Prompt-lookup (n-gram) speculative decoding of one padded batch, greedy: each row's next tokens are guessed
from the text that followed the first earlier occurrence of its last n tokens (n from NGRAM_MAX down to
NGRAM_MIN) in its prompt and its own output, and one forward over [last token, guesses] checks them all: a
guess is kept while it equals the model's argmax after the tokens before it, and the argmax after the last
kept guess comes with it. The output is the model's own greedy output; only the number of forwards changes.
This is vLLM's `ngram` method and transformers' `prompt_lookup_num_tokens` (which runs at batch size 1 only),
batched here over the padded backend's static cache. A small model's decode step on CPU costs its per-op
dispatch more than its arithmetic, so a step over 1 + m tokens per row costs far less than 1 + m steps
(TOKEN_COST, a setting tuned by hand on the demo model on 2 cores: about 1 + 0.15 m); how many guesses a step checks is chosen from
that cost and each row's rate of kept guesses so far (`_Run.draft_length`).

Rows accept different numbers of tokens, so each keeps its own length in the cache: a step writes row b's
keys at its own position (`kv_cache.write_ragged`), its real keys stay contiguous after its prompt (as in
plain decoding), and a 4-D mask hides the slots it has not filled and the padding before its prompt.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from train.generation.kv_cache import keep_rows, write_ragged

NGRAM_MIN, NGRAM_MAX = 1, 4   # n-gram lengths matched, longest first
TOKEN_COST = 0.15             # a step's cost per extra input token per row, relative to a one-token step


class Lookup:
    """One row's tokens and, per n-gram of NGRAM_MIN..NGRAM_MAX tokens, where its first occurrence is continued."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        toks, first = self.tokens, self.first
        for t in new:
            p = len(toks)
            for n in range(NGRAM_MIN, min(NGRAM_MAX, p) + 1):
                first.setdefault(tuple(toks[p - n:p]), p)
            toks.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest n-gram ending the sequence, at its first occurrence."""
        toks, end = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            at = self.first.get(tuple(toks[end - n:]))
            if at is not None:
                return toks[at:at + k]
        return []


def supported(model) -> bool:
    """Whether the model can decode this way: SDPA attention (the 4-D boolean mask is handed to it as is) and
    no sliding-window layers (their cache layers do not write rows at their own positions)."""
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"]
    return model.config._attn_implementation == "sdpa" and all(k == "full_attention" for k in kinds)


@functools.cache
def _packed_sdpa() -> str:
    """An attention function (registered with transformers) for a masked step over several query tokens of a
    GQA model: each key head's query heads are folded into its query rows, as transformers' SDPA path folds a
    single query token, where it would copy every key and value head group times (`repeat_kv`)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        rep = getattr(module, "num_key_value_groups", 1)
        if rep == 1 or attention_mask is None or query.shape[2] == 1 or attention_mask.shape[1] != 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        b, h, q, d = query.shape
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(b, h // rep, rep * q, d), key, value, attn_mask=attention_mask.repeat(1, 1, rep, 1),
            scale=scaling)
        return out.reshape(b, h, q, -1).transpose(1, 2).contiguous(), None

    AttentionInterface.register("smoltrain_packed_sdpa", attend)
    return "smoltrain_packed_sdpa"


@contextlib.contextmanager
def _attention(model):
    """The model's SDPA attention swapped for `_packed_sdpa` inside (other implementations kept as they are)."""
    before = model.config._attn_implementation
    if before != "sdpa":
        yield
        return
    model.set_attn_implementation(_packed_sdpa())
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@dataclass
class Stats:
    forwards: int = 0    # verifying forwards (the prefill's not counted)
    proposed: int = 0    # guessed tokens checked
    accepted: int = 0    # guessed tokens kept


def decode(model, prompts: list[list[int]], mask: torch.Tensor, cache, first: list[int], first_lps: list | None,
           params, checker, k: int, pad: int, stats: Stats | None = None) -> list[tuple[list[int], bool, list | None]]:
    """Greedy continuation of a batch after its prefill: `mask` [B, W] the attention mask of the rows the cache
    holds, `first` each row's first generated token (not yet in the cache), `first_lps` its log-prob (with
    params.logprobs). Per row: (tokens, whether it ended at a stop, log-probs or None). The cache needs room for
    W + max_new_tokens + k positions."""
    run = _Run(params, checker, stats if stats is not None else Stats(), first, first_lps)
    looks = [Lookup(p + [t]) for p, t in zip(prompts, first, strict=True)]
    rows = list(range(len(prompts)))            # batch position → row (finished rows stay until compacted)
    width = mask.shape[1]
    at = torch.full((len(prompts),), width)     # where each batch position writes its next keys
    pos = mask.sum(1)                           # its next token's position id
    valid = mask.bool()                         # which of its cache slots hold real keys
    last = torch.tensor(first)
    with _attention(model), torch.no_grad():
        while any(run.open[r] for r in rows):
            if sum(not run.open[r] for r in rows) * 4 >= len(rows):  # a quarter of the batch has finished
                keep = [j for j, r in enumerate(rows) if run.open[r]]
                cache = keep_rows(cache, keep, model.config)
                rows, at, pos, valid, last = [rows[j] for j in keep], at[keep], pos[keep], valid[keep], last[keep]
            drafts = [looks[r].propose(min(k, params.max_new_tokens - len(run.toks[r]) - 1)) if run.open[r] else []
                      for r in rows]
            m = run.draft_length(rows, drafts)
            drafts = [d[:m] for d in drafts]
            q = 1 + max(map(len, drafts))
            inp = torch.full((len(rows), q), pad)
            inp[:, 0] = last
            for j, d in enumerate(drafts):
                inp[j, 1:1 + len(d)] = torch.tensor(d, dtype=inp.dtype)
            span = int(at.max()) + q
            if valid.shape[1] < span:
                valid = torch.cat([valid, torch.ones(len(rows), span - valid.shape[1], dtype=torch.bool)], 1)
            step = torch.arange(q)
            # a query sees its row's real keys up to its own position: not the padding, not unfilled slots
            attn = valid[:, None, :span] & (torch.arange(span) <= (at[:, None] + step)[:, :, None])
            write_ragged(cache, at, span)
            logits = model(input_ids=inp, position_ids=pos[:, None] + step, attention_mask=attn[:, None],
                           cache=cache, use_cache=True).logits
            pred = logits.argmax(-1).tolist()
            run.stats.forwards += 1
            for j, (r, d) in enumerate(zip(rows, drafts, strict=True)):
                if run.open[r]:
                    new = run.accept(r, d, pred[j], logits[j])
                    looks[r].extend(new)
                    at[j] += len(new)
                    pos[j] += len(new)
                    last[j] = new[-1]
    return [(run.toks[r], run.ended[r], run.lps[r] if params.logprobs else None) for r in range(len(prompts))]


class _Run:
    """The rows' output so far: tokens, log-probs, whether each is still open, whether it ended at a stop."""

    def __init__(self, params, checker, stats: Stats, first: list[int], first_lps: list | None):
        self.params, self.checker, self.stats = params, checker, stats
        self.kept = [0] * len(first)     # per row: guesses kept, and drafts cut short by a wrong guess
        self.missed = [0] * len(first)
        self.toks = [[t] for t in first]
        self.lps = [[lp] for lp in first_lps] if params.logprobs else [[] for _ in first]
        self.ended = [False] * len(first)
        self.open = [not self._finished(r) for r in range(len(first))]

    def accept(self, r: int, draft: list[int], pred: list[int], logits: torch.Tensor) -> list[int]:
        """Row r's guesses kept while they equal the argmax (`pred`: per input position), then the argmax after
        them; each appended until the row finishes. Returns them all: the cache now holds keys for as many of the
        row's positions (the step's input token and the kept guesses)."""
        a = 0
        while a < len(draft) and draft[a] == pred[a]:
            a += 1
        self.stats.proposed += len(draft)
        self.stats.accepted += a
        self.kept[r] += a
        self.missed[r] += a < len(draft)
        new = draft[:a] + [pred[a]]
        kept = 0
        for t in new:
            self.toks[r].append(t)
            kept += 1
            if self._finished(r):
                self.open[r] = False
                break
        if self.params.logprobs:
            lp = torch.log_softmax(logits[:kept].float(), -1)
            self.lps[r] += lp.gather(1, torch.tensor(new[:kept])[:, None]).squeeze(1).tolist()
        return new

    def draft_length(self, rows: list[int], drafts: list[list[int]]) -> int:
        """How many guesses the step checks: the number that maximises the batch's expected new tokens per unit of
        step cost (1 + TOKEN_COST per guess). A row keeps its i-th guess with probability p**i, p its own rate
        so far (a guess kept when the ones before it were: kept / (kept + missed), with a prior of 1/2)."""
        gain = [float(sum(self.open[r] for r in rows))]   # gain[i]: expected tokens from the i-th guesses
        for r, d in zip(rows, drafts, strict=True):
            p, q = (self.kept[r] + 1) / (self.kept[r] + self.missed[r] + 2), 1.0
            gain += [0.0] * (len(d) + 1 - len(gain))
            for i in range(1, len(d) + 1):
                q *= p
                gain[i] += q
        best, best_m, total = gain[0], 0, gain[0]
        for m in range(1, len(gain)):
            total += gain[m]
            if total / (1 + TOKEN_COST * m) > best:
                best, best_m = total / (1 + TOKEN_COST * m), m
        return best_m

    def _finished(self, r: int) -> bool:
        """Whether row r ends at its last token: a stop (recorded in `ended`) or the token budget."""
        if self.checker.end(self.toks[r]) is not None:
            self.ended[r] = True
            return True
        return len(self.toks[r]) >= self.params.max_new_tokens
