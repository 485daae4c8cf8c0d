"""Tokenizers: train a byte-level BPE locally, load one, encode documents (EOS appended) per task.

`TokenizeStep` writes each task's tokens to the work dir (`{rank}.tokens.npy` + `{rank}.docs.json`);
`write_source` later packs them, in task order, into a source's shards, so shard bytes never depend on
how many workers ran. It also makes the held-out validation split: a document is a candidate when the
hash of (source, id) falls below `validation.fraction`; candidates with the smallest hashes go to
`validation/SOURCE/` up to the caps, all other documents to `SOURCE/`.

Rendered conversations (documents with `metadata["loss_spans"]`) are encoded with offsets, get no EOS
(the template's end-of-turn token ends them) and a loss mask from their spans (`{rank}.mask.npy`); one
longer than its source's `chat.max_tokens` is rejected (`too_long`, to `rejects/tokenize/`) or, with
`chat.truncate`, cut and counted (`truncated`). Per-task counts go in `{rank}.docs.json`.

A preference pair (documents with `metadata["pair"]`) becomes two documents, `ID#chosen` then
`ID#rejected` (`datapipe.preference.encode_pairs`; rejects `prompt_too_long` and `too_long`); the
shard writer keeps the two in one block, and the validation split hashes the pair id.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator

import numpy as np
import xxhash
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from datapipe.chat import token_mask
from datapipe.config import ChatConfig, ValidationConfig
from datapipe.preference import encode_pairs, pair_id
from datapipe.workfiles import atomic_json, atomic_npy, read_json
from storage.dataset import VALIDATION_PREFIX, SourceWriter
from storage.manifest import SourceInfo, TokenizerInfo
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
    from storage.fs import atomic_write_bytes

    atomic_write_bytes(out_path, tok.to_str().encode())
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
    """Encodes documents in batches (HF tokenizers, Rust threads), appends EOS, writes the task's tokens."""

    name = "🔢 tokenize"
    type = "🔢 - TOKENIZER"

    def __init__(self, tokenizer_path: str, eos_token: str, out_dir: str, batch_size: int = 256,
                 chat: dict[str, ChatConfig] | None = None, rejects: str | None = None):
        super().__init__()
        self.tokenizer_path, self.eos_token = tokenizer_path, eos_token
        self.out_dir, self.batch_size = out_dir, batch_size
        self.chat, self.rejects = chat or {}, rejects
        self._tok = None

    def __getstate__(self):
        return {**self.__dict__, "_tok": None}

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if self._tok is None:  # loaded once per process: its BPE word cache stays warm across tasks
            self._tok = load_tokenizer(self.tokenizer_path)
        tok = self._tok
        eos = tok.token_to_id(self.eos_token)
        dtype = dtype_for_vocab(tok.get_vocab_size(with_added_tokens=True))
        chunks, masks, ids, lengths = [], [], [], []
        counts: dict[str, int] = {}
        is_pairs = False
        batch = []

        def count(key: str, n: int = 1) -> None:
            counts[key] = counts.get(key, 0) + n
            self.stat_update(key, value=n)

        def flush():
            nonlocal is_pairs
            flat: list[int] = []
            chats = [d for d in batch if "loss_spans" in d.metadata]
            if chats and "pair" in chats[0].metadata:  # all of a task's documents come from one source
                is_pairs = True
                for doc, res, cut in encode_pairs(tok, chats, self.chat):
                    if not isinstance(res, list):
                        count(f"dropped_{res.reason}")
                        doc.metadata.update(filter="tokenize", filter_reason=str(res))
                        rej.write(doc, rank)
                        continue
                    if cut:
                        count("truncated")
                    for side_id, toks, mask in res:
                        flat += toks
                        masks.append(mask)
                        count("loss_tokens", int(mask.sum()))
                        ids.append(side_id)
                        lengths.append(len(toks))
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
                            count("dropped_too_long")
                            doc.metadata.update(filter="tokenize", filter_reason=f"too_long: {len(toks):,} tokens, "
                                                f"more than chat.max_tokens={cfg.max_tokens:,}{why}")
                            rej.write(doc, rank)
                            continue
                    flat += toks
                    masks.append(mask)
                    count("loss_tokens", int(mask.sum()))
                    ids.append(doc.id)
                    lengths.append(len(toks))
            else:
                for doc, enc in zip(batch, tok.encode_batch_fast([d.text for d in batch], add_special_tokens=False)):
                    toks = enc.ids
                    flat += toks
                    flat.append(eos)
                    ids.append(doc.id)
                    lengths.append(len(toks) + 1)
            chunks.append(np.array(flat, dtype=dtype))  # one conversion per batch, not per document
            batch.clear()

        from datatrove.pipeline.writers.jsonl import JsonlWriter

        rej_dir = self.rejects or os.path.join(self.out_dir, "rejects")
        with JsonlWriter(os.path.join(rej_dir, "tokenize"), output_filename="${rank}.jsonl.gz") as rej:
            for doc in data:
                self.stat_update("documents")
                batch.append(doc)
                if len(batch) >= self.batch_size:
                    flush()
            if batch:
                flush()
        tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
        self.stat_update("tokens", value=len(tokens))
        atomic_json(os.path.join(self.out_dir, f"{rank:05d}.docs.json"),
                    {"ids": ids, "lengths": lengths, "masked": bool(masks), "pairs": is_pairs, "counts": counts})
        if masks:
            atomic_npy(os.path.join(self.out_dir, f"{rank:05d}.mask.npy"), np.concatenate(masks))
        atomic_npy(os.path.join(self.out_dir, f"{rank:05d}.tokens.npy"), tokens)
        return
        yield


def iter_task_docs(token_dir: str, rank: int) -> Iterator[tuple[str, np.ndarray, np.ndarray | None]]:
    """(doc_id, tokens, loss mask or None) of one tokenize task's documents."""
    meta = read_json(os.path.join(token_dir, f"{rank:05d}.docs.json"))
    tokens = np.load(os.path.join(token_dir, f"{rank:05d}.tokens.npy"), allow_pickle=False)
    masks = (np.load(os.path.join(token_dir, f"{rank:05d}.mask.npy"), allow_pickle=False)
             if meta.get("masked") else None)
    off = 0
    for doc_id, n in zip(meta["ids"], meta["lengths"]):
        yield doc_id, tokens[off:off + n], None if masks is None else masks[off:off + n]
        off += n


VALIDATION_SEED = 0x5EED_0001  # fixed: the held-out set must not move between builds


def holdout_score(source: str, doc_id: str) -> float:
    """xxh64 (seed `VALIDATION_SEED`) of `SOURCE\\0DOC_ID`, its top 53 bits mapped to [0, 1)."""
    h = xxhash.xxh64_intdigest(f"{source}\0{doc_id}".encode(), seed=VALIDATION_SEED)
    return (h >> 11) * 2.0**-53


def select_validation(source: str, docs: Iterable[tuple[str, int]], cfg: ValidationConfig) -> set[int]:
    """Positions (in `docs` order) of the held-out documents among `docs` = (doc_id, tokens) pairs:
    candidates by `holdout_score < fraction`, smallest scores first, until a cap would be exceeded."""
    if not cfg.enabled:
        return set()
    cands = []
    for pos, (doc_id, n) in enumerate(docs):
        score = holdout_score(source, doc_id)
        if score < cfg.fraction:
            cands.append((score, pos, n))
    cands.sort()  # ties (equal ids) fall back to position, so the choice is still deterministic
    held: set[int] = set()
    tokens = 0
    for _, pos, n in cands:
        if cfg.max_documents is not None and len(held) + 1 > cfg.max_documents:
            break
        if cfg.max_tokens is not None and tokens + n > cfg.max_tokens:
            break
        held.add(pos)
        tokens += n
    return held


def write_source(dataset: str, source: str, ranks: list[int], token_dir: str, dtype: str, block_tokens: int,
                 shard_blocks: int, validation: ValidationConfig | None = None) -> tuple[SourceInfo, SourceInfo]:
    """Pack one source's tokenized tasks, in rank order, into shards (format v2 blocks for conversations):
    (training, held-out). A preference source's pairs (two consecutive documents) are held out by pair id
    and written as groups, so both sides share a block and a split."""
    cfg = validation or ValidationConfig(fraction=0.0)
    metas = [read_json(os.path.join(token_dir, f"{r:05d}.docs.json")) for r in ranks]
    pairs = any(m.get("pairs") for m in metas)
    docs = [(i, n) for m in metas for i, n in zip(m["ids"], m["lengths"])]
    if pairs:
        docs = [(pair_id(c[0]), c[1] + r[1]) for c, r in zip(docs[::2], docs[1::2])]
    held = select_validation(source, docs, cfg)
    kind = "preference" if pairs else None
    train = SourceWriter(dataset, source, dtype, block_tokens=block_tokens, shard_blocks=shard_blocks, kind=kind)
    val = SourceWriter(dataset, source, dtype, block_tokens=block_tokens, shard_blocks=shard_blocks,
                       prefix=VALIDATION_PREFIX, kind=kind)
    try:
        pos = 0
        for r in ranks:
            it = iter_task_docs(token_dir, r)
            for doc in it:
                group = [doc, next(it)] if pairs else [doc]
                (val if pos in held else train).add_group(group)
                pos += 1
    except BaseException:
        train.abort()
        val.abort()
        raise
    return train.close(), val.close()
