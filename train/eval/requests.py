"""Multiple-choice requests → token ids exactly as lm-evaluation-harness's HF backend forms them, and the
per-task metrics computed from per-candidate log-likelihoods. Shared by every scoring backend (the
Megatron scorer and `train eval --hf`), so they differ only in how log-probs are computed.

Encoding (lm-eval `_encode_pair`): trailing spaces of the context move to the continuation; the whole
string is encoded and split at the length of the encoded context; an empty context becomes the
prefix token (EOS). Inputs longer than `max_length + 1` lose tokens on the left, as lm-eval does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from storage.evaltasks import Item


@dataclass
class Encoded:
    """One candidate: context and continuation token ids (context already cut on the left to fit)."""
    context: list[int]
    continuation: list[int]


def encode_pair(tok, context: str, continuation: str, prefix_token_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) for one request; `tok` is a `tokenizers.Tokenizer`."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    if not context:
        return [prefix_token_id], tok.encode(continuation, add_special_tokens=False).ids
    whole = tok.encode(context + continuation, add_special_tokens=False).ids
    ctx = tok.encode(context, add_special_tokens=False).ids
    return ctx, whole[len(ctx):]


def encode_items(tok, items: list[Item], max_length: int, prefix_token_id: int) -> list[list[Encoded]]:
    """Per item, per candidate: the ids the model sees (at most max_length inputs + 1 target)."""
    out = []
    for it in items:
        cands = []
        for r in it.requests:
            ctx, cont = encode_pair(tok, r.context, r.continuation, prefix_token_id)
            if not cont:
                raise ValueError(f"task {it.task} item {it.item_id}: continuation {r.continuation!r} encodes "
                                 "to no tokens")
            whole = (ctx + cont)[-(max_length + 1):]
            cands.append(Encoded(whole[:len(whole) - len(cont)], cont[-len(whole):]))
        out.append(cands)
    return out


def item_metrics(item: Item, logliks: list[float], n_tokens: list[int]) -> dict:
    """acc (raw sum), acc_norm (per character of the continuation), acc_token (per token), for one item."""
    def argmax(xs):
        return max(range(len(xs)), key=lambda i: (xs[i], -i))  # ties: the first candidate, as numpy does

    chars = [len(r.continuation) for r in item.requests]
    pred = argmax(logliks)
    pred_norm = argmax([ll / max(c, 1) for ll, c in zip(logliks, chars)])
    pred_tok = argmax([ll / max(n, 1) for ll, n in zip(logliks, n_tokens)])
    return {"acc": float(pred == item.label), "acc_norm": float(pred_norm == item.label),
            "acc_token": float(pred_tok == item.label)}


def bits_per_byte(item: Item, logliks: list[float]) -> float:
    """The gold candidate's negative log-likelihood in bits per UTF-8 byte of its text (OLMo's `bpb`)."""
    return -logliks[item.label] / math.log(2) / max(1, len(item.answer.encode("utf-8")))


def task_metrics(items: list[Item], logliks: list[list[float]], n_tokens: list[list[int]], kind: str = "choice") -> dict:
    """Means of the item metrics over a task, with the item count and the standard error of acc; a `bpb` task
    (one gold request per item) gets the mean bits per byte and its standard error instead."""
    if kind == "bpb":
        bpb = [bits_per_byte(it, ll) for it, ll in zip(items, logliks)]
        n = len(bpb)
        mean = sum(bpb) / n if n else float("nan")
        var = sum((b - mean) ** 2 for b in bpb) / max(n - 1, 1) if n else 0.0
        return {"bpb": mean, "bpb_stderr": math.sqrt(var / max(n, 1)), "items": n}
    per = [item_metrics(it, ll, nt) for it, ll, nt in zip(items, logliks, n_tokens)]
    n = len(per)
    out = {k: sum(p[k] for p in per) / n for k in ("acc", "acc_norm", "acc_token")} if n else {}
    if n:
        out["acc_stderr"] = math.sqrt(out["acc"] * (1 - out["acc"]) / max(n - 1, 1))
        out["chance"] = sum(1.0 / len(it.requests) for it in items) / n
    out["items"] = n
    return out
