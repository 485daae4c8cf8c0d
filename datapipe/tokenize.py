"""Tokenizers: train a byte-level BPE locally, load one, encode documents (EOS appended) per task.

`TokenizeStep` packs each task's encoded documents straight into the task's shards and sets validation
candidates aside (`datapipe.shardout`), so shard bytes never depend on how many workers ran.

Rendered conversations (documents with `metadata["loss_spans"]`) are encoded with offsets, get no EOS
(the template's end-of-turn token ends them) and a loss mask from their spans; one longer than its
source's `chat.max_tokens` is rejected (`too_long`, to `rejects/tokenize/`) or, with `chat.truncate`,
cut and counted (`truncated`). Per-task counts go in the task's `tasks/RANK.json`.

A preference pair (documents with `metadata["pair"]`) becomes two documents, `ID#chosen` then
`ID#rejected` (`datapipe.preference.encode_pairs`; rejects `prompt_too_long` and `too_long`); the
shard writer keeps the two in one block, and the validation split hashes the pair id.

An RL prompt (documents with `metadata["kind"] == "prompts"`) is encoded without EOS or mask and written
with its answer as block metadata (`datapipe.prompts.encode_prompts`; reject `too_long`, never truncated).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from itertools import chain

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from storage.chat import token_mask
from datapipe.config import ChatConfig
from datapipe.kinds import KINDS_WITH_META, doc_meta
from datapipe.preference import encode_pairs, pair_id
from datapipe.prompts import KIND as PROMPTS, encode_prompts
from datapipe.shardout import ShardOut, TaskShards
from storage.manifest import TokenizerInfo
from storage.shards import dtype_for_vocab


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str, out_path: str,
              special_tokens: Iterable[str] = ()) -> str:
    """Train a byte-level BPE (GPT-2 style pre-tokenizer) on `texts`; save tokenizer.json; return its path.
    `special_tokens` (e.g. a chat template's control tokens) become single special tokens after EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(dict.fromkeys([eos_token, *special_tokens]))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    from storage import atomic

    atomic.write_bytes(out_path, tok.to_str().encode())
    return out_path


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from a local tokenizer.json, or a hub name (needs network)."""
    from tokenizers import Tokenizer

    if os.path.isfile(path):
        return Tokenizer.from_file(path)
    if path.endswith(".json") or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable():
        raise FileNotFoundError(f"tokenizer {path!r} is not a local file and the Hugging Face hub is not reachable "
                                "(offline); give the path of a tokenizer.json, or train one with "
                                "`datapipe tokenizer train`")
    try:
        return Tokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - offline: a clear error instead of a hang or a stack of HTTP errors
        raise FileNotFoundError(f"tokenizer {path!r} is not a local file and could not be fetched from the hub "
                                f"({type(e).__name__}: {e}); give the path of a tokenizer.json") from None


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """A quick TCP probe, so an offline machine gets a clear error at once instead of minutes of retries."""
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def check_special_tokens(tok, tokens: Iterable[str], where: str) -> None:
    """A ConfigError naming every token of `tokens` that `tok` does not hold as one token."""
    from storage.config import ConfigError

    missing = [t for t in tokens if tok.token_to_id(t) is None]
    if missing:
        raise ConfigError(f"{where}: the tokenizer lacks the chat template's special tokens {missing} (add them "
                          "as special tokens, or leave tokenizer.path empty to train one that has them)")


def tokenizer_info(path: str, eos_token: str) -> TokenizerInfo:
    tok = load_tokenizer(path)
    eos = tok.token_to_id(eos_token)
    if eos is None:
        raise ValueError(f"tokenizer {path}: has no EOS token {eos_token!r}")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    return TokenizerInfo(file=os.path.basename(path), sha256=sha, vocab_size=vocab, eos_id=eos,
                         dtype=dtype_for_vocab(vocab).name)


class TokenizeStep(PipelineStep):
    """Encodes documents in batches (HF tokenizers, Rust threads), appends EOS, and packs them into the
    task's shards (`datapipe.shardout.TaskShards`)."""

    name = "🔢 tokenize"
    type = "🔢 - TOKENIZER"

    def __init__(self, tokenizer_path: str, eos_token: str, out: ShardOut, source_of_rank: list[str],
                 batch_size: int = 256, chat: dict[str, ChatConfig] | None = None, rejects: str | None = None,
                 kinds: dict[str, str] | None = None):
        """`kinds`: source → kind; code and math documents carry `doc_meta` (`datapipe.kinds.doc_meta`)."""
        super().__init__()
        self.tokenizer_path, self.eos_token = tokenizer_path, eos_token
        self.out, self.source_of_rank, self.batch_size = out, source_of_rank, batch_size
        self.chat, self.rejects, self.kinds = chat or {}, rejects, kinds or {}
        self._tok = None

    def __getstate__(self):
        return {**self.__dict__, "_tok": None}

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if self._tok is None:  # loaded once per process: its BPE word cache stays warm across tasks
            self._tok = load_tokenizer(self.tokenizer_path)
        tok = self._tok
        eos = tok.token_to_id(self.eos_token)
        eos_t = (eos,)
        dtype = dtype_for_vocab(tok.get_vocab_size(with_added_tokens=True))
        sink = TaskShards(self.out, self.source_of_rank[rank], rank, dtype.name)
        counts: dict[str, int] = {}
        batch = []

        def count(key: str, n: int = 1) -> None:
            counts[key] = counts.get(key, 0) + n
            self.stat_update(key, value=n)

        def reject(doc, reason: str, why: str) -> None:
            count(f"dropped_{reason}")
            doc.metadata.update(filter="tokenize", filter_reason=why)
            rej.write(doc, rank)

        def flush():
            chats = [d for d in batch if "loss_spans" in d.metadata]
            if batch[0].metadata.get("kind") == PROMPTS:  # all of a task's documents come from one source
                for doc, ids, why in encode_prompts(tok, batch, self.chat):
                    if why:
                        reject(doc, "too_long", why)
                        continue
                    meta = doc.metadata["prompt"]
                    if "answer" in meta:
                        count("with_answer")
                    sink.add_group(doc.id, [(doc.id, np.asarray(ids, dtype=dtype), None)], [meta])
            elif chats and "pair" in chats[0].metadata:
                for doc, res, cut in encode_pairs(tok, chats, self.chat):
                    if not isinstance(res, list):
                        reject(doc, res.reason, str(res))
                        continue
                    if cut:
                        count("truncated")
                    count("loss_tokens", sum(int(m.sum()) for _, _, m in res))
                    sink.add_group(pair_id(res[0][0]), [(i, np.asarray(t, dtype=dtype), m) for i, t, m in res])
            elif chats:
                for doc, enc in zip(chats, tok.encode_batch([d.text for d in chats], add_special_tokens=False)):
                    cfg = self.chat.get(doc.metadata.get("source"), ChatConfig())
                    toks, mask = enc.ids, token_mask(enc, doc.metadata["loss_spans"], len(enc.ids))
                    if len(toks) > cfg.max_tokens:
                        if cfg.truncate and mask[:cfg.max_tokens].any():
                            toks, mask = toks[:cfg.max_tokens], mask[:cfg.max_tokens]
                            count("truncated")
                        else:
                            why = "; nothing to train on before the cut" if cfg.truncate else ""
                            reject(doc, "too_long", f"too_long: {len(toks):,} tokens, more than "
                                   f"chat.max_tokens={cfg.max_tokens:,}{why}")
                            continue
                    count("loss_tokens", int(mask.sum()))
                    sink.add_group(doc.id, [(doc.id, np.asarray(toks, dtype=dtype), mask)])
            else:
                # `Encoding.ids` builds a new list on each access: read once; one conversion per batch
                # (np.fromiter over the chained lists: half the cost of np.array on one flat list)
                ids = [e.ids for e in tok.encode_batch_fast([d.text for d in batch], add_special_tokens=False)]
                lengths = [len(x) + 1 for x in ids]
                arr = np.fromiter(chain.from_iterable(x for i in ids for x in (i, eos_t)), dtype=dtype,
                                  count=sum(lengths))
                kind = self.kinds.get(self.source_of_rank[rank], "web")
                meta = [doc_meta(kind, d.metadata) for d in batch] if kind in KINDS_WITH_META else None
                sink.add_documents([d.id for d in batch], arr, lengths, meta)
            self.stat_update("documents", value=len(batch))
            batch.clear()

        from datapipe.rejects import RejectsWriter

        rej_dir = self.rejects or os.path.join(self.out.work, "rejects")
        try:
            with RejectsWriter(os.path.join(rej_dir, "tokenize")) as rej:
                for doc in data:
                    batch.append(doc)
                    if len(batch) >= self.batch_size:
                        flush()
                if batch:
                    flush()
        except BaseException:
            sink.abort()
            raise
        sink.close(counts)
        return
        yield
