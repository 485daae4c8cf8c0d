"""Validation loss on the dataset's held-out split: loss, perplexity and bits per byte per source and
overall, on a fixed set of sequences.

Each source's held-out documents (written by `datapipe build`, `validation:` in the build config) are
concatenated in manifest order, as training concatenates documents, and cut into windows of seq_len + 1
tokens with a stride of seq_len (every target token is predicted once), up to `validation_tokens`
target tokens per source. The sequences depend only on the dataset, seq_len and that budget, so the
same checkpoint gives the same numbers under any parallel layout: each sequence's summed token loss is
computed once (train.eval.scorer) and the sums are added in sequence order, over the global token count.

A chat source (SFT data) is scored as it is trained: each held-out conversation in a row of its own,
loss over the tokens its mask marks (assistant turns), until `validation_tokens` such tokens.

Bits per byte divide the summed loss (in bits) by the UTF-8 bytes of the target tokens, so runs with
different tokenizers compare. A byte-level BPE token's bytes are the characters of its vocabulary
string; other tokenizers use the length of the decoded token; special tokens (EOS) count 0 bytes.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from train.eval.scorer import Row, Scorer


class NoValidationSet(RuntimeError):
    """The dataset was built without a held-out split."""


def token_bytes(tokenizer_path: str) -> np.ndarray:
    """UTF-8 bytes of every token id of a tokenizer.json (0 for special tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    with open(tokenizer_path, encoding="utf-8") as f:
        spec = json.load(f)
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    n = tok.get_vocab_size(with_added_tokens=True)
    out = np.zeros(n, dtype=np.int64)
    for i in range(n):
        if i in special:
            continue
        s = tok.id_to_token(i)
        if s is None:
            continue
        out[i] = len(s) if byte_level else len(tok.decode([i], skip_special_tokens=True).encode("utf-8"))
    return out


@dataclass
class ValidationSet:
    rows: dict[str, list[Row]]          # per source, in order
    target_bytes: dict[str, list[int]]  # UTF-8 bytes of each row's targets

    @classmethod
    def from_dataset(cls, dataset: str, seq_len: int, tokens_per_source: int) -> "ValidationSet":
        from storage import fs
        from storage.dataset import iter_documents
        from storage.manifest import read_manifest

        man = read_manifest(dataset)
        if not man.validation:
            raise NoValidationSet(f"dataset {dataset} has no validation split (built before held-out sets "
                                  "existed, or with validation.fraction 0); rebuild it with `datapipe build` "
                                  "and a `validation:` section, or set eval.validation_tokens: 0")
        nbytes = token_bytes(fs.join(dataset, man.tokenizer.file))
        rows: dict[str, list[Row]] = {}
        tbytes: dict[str, list[int]] = {}
        n_rows = max(1, tokens_per_source // seq_len)
        for source, info in man.validation.items():
            if man.sources[source].kind == "preference":  # scored by objective dpo's held-out pair metrics
                continue
            if man.sources[source].kind == "chat":
                rows[source], tbytes[source] = _conversation_rows(dataset, info.shards, seq_len, tokens_per_source,
                                                                  nbytes)
                continue
            need = n_rows * seq_len + 1
            parts, have = [], 0
            for _, toks in iter_documents(dataset, info.shards):
                parts.append(np.asarray(toks, dtype=np.int64))
                have += len(toks)
                if have >= need:
                    break
            if not parts:
                continue
            stream = np.concatenate(parts)[:need]
            rs, bs = [], []
            for start in range(0, len(stream) - 1, seq_len):
                window = stream[start:start + seq_len + 1]
                if len(window) < 2:
                    break
                rs.append(Row(window[:-1].tolist(), window[1:].tolist(), [(0, len(window) - 1)]))
                bs.append(int(nbytes[window[1:]].sum()))
            rows[source], tbytes[source] = rs, bs
        return cls(rows, tbytes)

    def evaluate(self, scorer: Scorer) -> dict[str, float]:
        """{'val/<source>/loss|ppl|bpb|tokens', 'val/all/...'}: token-weighted over every sequence."""
        flat = [(s, i) for s, rs in self.rows.items() for i in range(len(rs))]
        scores = scorer.score([self.rows[s][i] for s, i in flat])
        per: dict[str, list[float]] = {}
        for (s, i), sc in zip(flat, scores):
            per.setdefault(s, []).append(math.fsum(sc))
        out: dict[str, float] = {}
        tot_nats = tot_tokens = tot_bytes = 0.0
        for s, sums in per.items():
            nats = -math.fsum(sums)
            tokens = sum(e - a for r in self.rows[s] for a, e in r.spans)
            nbytes = sum(self.target_bytes[s])
            out.update(_summary(f"val/{s}", nats, tokens, nbytes))
            tot_nats += nats
            tot_tokens += tokens
            tot_bytes += nbytes
        if per:
            out.update(_summary("val/all", tot_nats, tot_tokens, tot_bytes))
        return out


def _conversation_rows(dataset: str, shards, seq_len: int, budget: int, nbytes: np.ndarray):
    """A chat source's held-out conversations, one row each (cut to seq_len + 1 tokens), scored on the
    tokens their loss mask marks (what SFT trains on), until `budget` such tokens."""
    from storage.dataset import iter_documents

    rows, tbytes, have = [], [], 0
    for _, toks, mask in iter_documents(dataset, shards, with_mask=True):
        toks = np.asarray(toks, dtype=np.int64)[:seq_len + 1]
        lab_mask = np.asarray(mask, dtype=bool)[1:len(toks)]
        if len(toks) < 2 or not lab_mask.any():
            continue
        edges = np.flatnonzero(np.diff(np.concatenate([[0], lab_mask.astype(np.int8), [0]])))
        spans = [(int(a), int(e)) for a, e in zip(edges[::2], edges[1::2])]
        rows.append(Row(toks[:-1].tolist(), toks[1:].tolist(), spans))
        tbytes.append(int(nbytes[toks[1:][lab_mask]].sum()))
        have += int(lab_mask.sum())
        if have >= budget:
            break
    return rows, tbytes


def _summary(prefix: str, nats: float, tokens: float, nbytes: float) -> dict[str, float]:
    loss = nats / tokens
    return {f"{prefix}/loss": loss, f"{prefix}/ppl": math.exp(min(loss, 700.0)),
            f"{prefix}/bpb": nats / math.log(2) / nbytes if nbytes else float("nan"), f"{prefix}/tokens": tokens}
