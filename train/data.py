"""The trainer's data source, by the kind of rows an objective reads (train.objectives `data`): storage's
streaming `TokenLoader` ("tokens": pretraining windows), its `ConversationLoader` ("conversations": whole
documents packed), its `PairLoader` ("pairs": preference pairs), or in-memory synthetic tokens.

Every rank of a DP replica (its TP and PP peers) opens the same loader slice, so no broadcast is needed;
the order is global and DP-independent (storage/loader), so a resume may change the DP size.
"""
from __future__ import annotations

import dataclasses
import time

import torch


class SyntheticLoader:
    """Random tokens, a pure function of (seed, global batch index): rank r takes rows [r·G/W, (r+1)·G/W).

    Same interface as storage's TokenLoader (next, state_dict, load_state_dict, metrics, close)."""

    def __init__(self, vocab: int, seq_len: int, global_batch_size: int, seed: int, dp_rank: int = 0,
                 dp_size: int = 1):
        self.vocab, self.seq_len, self.G, self.seed = vocab, seq_len, global_batch_size, seed
        self.rank, self.world = dp_rank, dp_size
        self.rows = global_batch_size // dp_size
        self.consumed = 0
        self._wait = 0.0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.consumed // self.G)
        batch = torch.randint(0, self.vocab, (self.G, self.seq_len + 1), generator=g)
        self.consumed += self.G
        out = batch[self.rank * self.rows:(self.rank + 1) * self.rows].clone()
        self._wait += time.perf_counter() - t0
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed = int(sd["consumed"])

    def metrics(self) -> dict:
        return {"wait_s": self._wait, "sequences": self.consumed}

    def close(self) -> None:
        pass


def make_loader(cfg, par, kind: str = "tokens"):
    """This rank's loader of `kind` rows (a TrainConfig `cfg`) for its DP slice of every global batch;
    under a batch ramp-up, of every unit of micro_batch_size × DP sequences, a step taking as many units
    as its batch needs (train.rampup)."""
    p = cfg.parallel
    gbs = p.micro_batch_size * par.dp if p.batch_rampup else p.global_batch_size
    if cfg.debug.synthetic_data:
        return SyntheticLoader(cfg.model.resolved().vocab_size, cfg.data.seq_len, gbs, cfg.data.seed, par.dp_rank,
                               par.dp)
    if kind in EPOCH_LOADERS:
        return EPOCH_LOADERS[kind]()(cfg.data, global_batch_size=p.global_batch_size, dp_rank=par.dp_rank,
                                     dp_size=par.dp)
    from storage.loader.loader import TokenLoader
    from storage.manifest import Phase

    lcfg = cfg.data
    mix = [Phase("stage", dict(lcfg.mix), 1)] if lcfg.mix else None
    if par.device.type == "cuda" and lcfg.device == "cpu":
        lcfg = dataclasses.replace(lcfg, device=str(par.device))  # pinned memory + side stream
    return TokenLoader(lcfg, global_batch_size=gbs, dp_rank=par.dp_rank, dp_size=par.dp, mix=mix)


def _pairs():
    from storage.loader.pairs import PairLoader
    return PairLoader


def _conversations():
    from storage.loader.conversations import ConversationLoader
    return ConversationLoader


def _prompts():
    from storage.loader.prompts import PromptLoader
    return PromptLoader


# loaders over a finite set of whole rows (epochs are defined); the token stream is endless
EPOCH_LOADERS = {"pairs": _pairs, "conversations": _conversations, "prompts": _prompts}


def rows_in_epochs(data_cfg, kind: str, epochs: float) -> int:
    """Loader rows (pairs, packed rows) in `epochs` passes over the dataset of a `kind` loader."""
    with EPOCH_LOADERS[kind]()(data_cfg, 1) as ld:
        return ld.rows_in_epochs(epochs)
