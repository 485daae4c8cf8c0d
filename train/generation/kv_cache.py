"""The padded backend's KV cache: transformers' StaticCache with layers that give attention only their filled
positions, set up for a batch (a prefix its prompts share run once) and cut down to the rows that are still
generating."""
from __future__ import annotations

import functools

import torch

SHARED_PREFIX = 32  # tokens a batch's prompts must share before the prefix is run once


def prefilled_cache(model, prompts: list[list[int]], max_new_tokens: int, pad: int):
    """(input ids, attention mask, the batch's static KV cache: empty, or holding the prompts' shared prefix).

    Without a shared prefix the rows are left-padded and `generate` prefills them in one forward: over the
    filled layers its attention spans the prompts only (unpadded rows of one length: no mask, causal), where
    a plain static cache masks every query against the whole cache, decode room included (~3x the attention
    of 8-shot GSM8K's causal prefill). With a shared prefix of at least SHARED_PREFIX tokens the prefix is
    run once and copied into every row; rows are laid out [prefix][padding][rest of the prompt] and
    `generate` prefills the rests on top of it."""
    shared = common_prefix(prompts) if len(prompts) > 1 else 0
    shared = min(shared, min(map(len, prompts)) - 1)  # every row keeps a token for the first step's logits
    if shared < SHARED_PREFIX:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return ids, mask, _static_cache(model.config, width + max_new_tokens)
    head, rest = prompts[0][:shared], [p[shared:] for p in prompts]
    w = max(map(len, rest))
    ids = torch.tensor([head + [pad] * (w - len(r)) + r for r in rest])
    mask = torch.tensor([[1] * shared + [0] * (w - len(r)) + [1] * len(r) for r in rest])
    with torch.no_grad():
        pre = model(torch.tensor([head]), use_cache=True, logits_to_keep=1).cache
    cache = _static_cache(model.config, shared + w + max_new_tokens)
    for i, layer in enumerate(pre.layers):
        cache.update(layer.keys.expand(len(prompts), -1, -1, -1), layer.values.expand(len(prompts), -1, -1, -1), i)
    return ids, mask, cache


def _static_cache(config, max_cache_len: int):
    """transformers' StaticCache (preallocated, written in place) whose attention layers hand attention only their
    filled positions (`_filled_layer_class`)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    filled = _filled_layer_class()
    cache.layers = [filled(max_cache_len) if type(layer) is StaticLayer else layer for layer in cache.layers]
    return cache


@functools.cache
def _filled_layer_class():
    """A StaticLayer that returns (and sizes the attention mask to) its filled positions, not all max_cache_len:
    decode attention reads no empty slots, and rows without padding need no mask at all (transformers then
    drops it), where the plain static layer masks the empty slots at every step (~1.6 ms of `where` per
    decode step of the demo model at batch 32). Not compileable: its shapes grow."""
    from transformers.cache_utils import StaticLayer

    class FilledLayer(StaticLayer):
        is_compileable = False
        ragged: tuple[torch.Tensor, int] | None = None  # set by `write_ragged`

        def update(self, key_states, value_states, *args, **kwargs):
            if self.ragged is not None:
                at, width = self.ragged
                idx = (at[:, None] + torch.arange(key_states.shape[2]))[:, None, :, None]
                self.keys.scatter_(2, idx.expand_as(key_states), key_states)
                self.values.scatter_(2, idx.expand_as(value_states), value_states)
                return self.keys[:, :, :width], self.values[:, :, :width]
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            n = int(self.cumulative_length)
            return keys[:, :, :n], values[:, :, :n]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return int(self.get_seq_length()) + query_length, 0

    return FilledLayer


def write_ragged(cache, at: torch.Tensor, width: int) -> None:
    """The next forward writes row b's keys at positions at[b], at[b] + 1, ... (rows of one batch at their own
    lengths: speculative decoding accepts a different number of tokens per row) and gives attention the first
    `width` positions of every row; the caller's 4-D mask hides what a row has not filled."""
    for layer in cache.layers:
        layer.ragged = (at, width)
        layer.cumulative_length.fill_(width)


def keep_rows(cache, rows: list[int], config):
    """A static cache holding only `rows` of `cache` (their filled positions copied)."""
    n, idx = int(cache.get_seq_length()), torch.tensor(rows)
    out = _static_cache(config, cache.layers[0].max_cache_len)
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys[idx, :, :n], layer.values[idx, :, :n], i)
    return out


def common_prefix(seqs: list[list[int]]) -> int:
    """Length of the longest prefix all of `seqs` share."""
    first, n = seqs[0], min(map(len, seqs))
    for k in range(n):
        t = first[k]
        if any(s[k] != t for s in seqs):
            return k
    return n
