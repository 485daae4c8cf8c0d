"""FineWeb-Edu's recipe: a linear regression head on the embeddings of a frozen local encoder.

- Encoder: a local Hugging Face folder (AutoModel + AutoTokenizer, `local_files_only`, safetensors weights
  only: no hub, no pickle), frozen, in float32 on the CPU. Its fingerprint is the sha256 of its weights
  file (of the sorted list of file hashes for a sharded folder); a head refuses an encoder that changed.
- Embedding: the mean of the last hidden states over the real tokens (attention mask), texts cut at
  `max_length` tokens. Mean pooling rather than the CLS state: it is a sentence embedding for any encoder,
  whereas CLS is one only for encoders trained to make it one (snowflake-arctic-embed is, a plain BERT's
  CLS is not), and the head is linear on a frozen encoder.
- Head: `score = w·x + b`, trained with torch (MSE, Adam, seeded, CPU, one thread, a fixed batch order)
  on standardised embeddings, then folded back to raw embeddings; zero-initialised, bias at the mean.
- Scores are clipped to the head's score range; `int_score = floor(score + 0.5)` (FineWeb-Edu rounds the
  clipped score). With integer training scores, the cut at threshold T is `score >= T - 0.5`, which is
  `int_score >= T`; with other scores it is `score >= T`.

A head folder holds `head.safetensors` (weight [1, hidden], bias [1]) and `head.json` (encoder path and
fingerprint, max length, pooling, score range, threshold, cut, training settings); same data, encoder and
seed give byte-identical files.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os

import numpy as np
from storage.fs import file_sha256

HEAD_JSON, HEAD_WEIGHTS = "head.json", "head.safetensors"
FORMAT = "smoltrain-quality-head/1"


class HeadError(ValueError):
    """An encoder or head folder that cannot be used; the message names the folder."""


def encoder_fingerprint(folder: str) -> str:
    """sha256 of the encoder's safetensors weights (one file), or of `name sha256` lines (several)."""
    if not os.path.isdir(folder):
        raise HeadError(f"encoder {folder!r} is not a local folder (a Hugging Face model folder with safetensors "
                        "weights; datapipe never downloads models)")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise HeadError(f"encoder {folder!r} has no .safetensors weights (only safetensors are loaded)")
    if len(files) == 1:
        return file_sha256(os.path.join(folder, files[0]))
    return hashlib.sha256("".join(f"{f} {file_sha256(os.path.join(folder, f))}\n" for f in files).encode()).hexdigest()


@contextlib.contextmanager
def _threads(n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class Encoder:
    """A frozen local encoder that turns texts into mean-pooled embeddings."""

    def __init__(self, folder: str, max_length: int = 512, batch_size: int = 32):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.fingerprint = encoder_fingerprint(folder)
        self.folder, self.max_length, self.batch_size = os.path.abspath(folder), max_length, batch_size
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self.model = AutoModel.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                   dtype=torch.float32).eval()
        except (OSError, ValueError) as e:
            raise HeadError(f"encoder {folder!r}: {str(e).splitlines()[0]}") from None
        self.model.requires_grad_(False)
        self.hidden_size = int(self.model.config.hidden_size)

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), hidden] float32, in batches of `batch_size` in the given order."""
        import torch

        out = np.zeros((len(texts), self.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = texts[start:start + self.batch_size]
                enc = self.tokenizer(batch, truncation=True, max_length=self.max_length, padding=True,
                                     return_tensors="pt")
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
                out[start:start + len(batch)] = pooled.numpy()
        return out


def train_head(x: np.ndarray, y: np.ndarray, seed: int, epochs: int = 20, lr: float = 1e-3,
               batch_size: int = 64) -> tuple[np.ndarray, float]:
    """A linear head `x @ w + b ≈ y` (MSE), deterministic: standardised inputs, zero init, Adam, batches in a
    seeded order, one thread. Returns (w [hidden] float32, b)."""
    import torch

    mean = x.astype(np.float64).mean(0)
    std = x.astype(np.float64).std(0) + 1e-6
    xs = torch.from_numpy(((x - mean) / std).astype(np.float32))
    ys = torch.from_numpy(y.astype(np.float32))
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(x.shape[1], 1)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.fill_(float(ys.mean()))
    opt = torch.optim.Adam(lin.parameters(), lr=lr)
    with _threads(1):
        for _ in range(epochs):
            order = torch.randperm(len(ys), generator=gen)
            for start in range(0, len(ys), batch_size):
                idx = order[start:start + batch_size]
                loss = torch.nn.functional.mse_loss(lin(xs[idx]).squeeze(-1), ys[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    w = lin.weight.detach().numpy().reshape(-1).astype(np.float64)
    b = float(lin.bias.detach().numpy()[0])
    w_raw = w / std  # folded back: the head reads raw embeddings
    return w_raw.astype(np.float32), float(b - (w_raw * mean).sum())


def cut_of(threshold: float, integer_scores: bool) -> float:
    """The score a kept document reaches: `T - 0.5` for integer scores (`int_score >= T`), else T."""
    return threshold - 0.5 if integer_scores else threshold


def save_head(folder: str, w: np.ndarray, b: float, encoder: Encoder, score_range: tuple[float, float],
              threshold: float, integer_scores: bool, train: dict) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({"weight": torch.from_numpy(np.ascontiguousarray(w.reshape(1, -1))),
               "bias": torch.tensor([b], dtype=torch.float32)}, os.path.join(folder, HEAD_WEIGHTS))
    meta = {"format": FORMAT, "encoder": encoder.folder, "encoder_sha256": encoder.fingerprint,
            "max_length": encoder.max_length, "pooling": "mean", "hidden_size": encoder.hidden_size,
            "score_range": [float(score_range[0]), float(score_range[1])], "threshold": float(threshold),
            "integer_scores": integer_scores, "cut": cut_of(threshold, integer_scores), "train": train}
    with open(os.path.join(folder, HEAD_JSON), "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def read_head_meta(folder: str) -> dict:
    """head.json of a head folder, checked for the keys the filter reads."""
    path = os.path.join(folder, HEAD_JSON)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise HeadError(f"{folder!r} holds no {HEAD_JSON} (an embedding-head folder written by `datapipe classifier "
                        "train --kind embedding`)") from None
    except json.JSONDecodeError as e:
        raise HeadError(f"{path}: not JSON ({e.msg})") from None
    if meta.get("format") != FORMAT:
        raise HeadError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if not os.path.isfile(os.path.join(folder, HEAD_WEIGHTS)):
        raise HeadError(f"{folder!r} holds no {HEAD_WEIGHTS}")
    return meta


def check_encoder(meta: dict, folder: str) -> None:
    """The head's encoder is there and unchanged since training."""
    fp = encoder_fingerprint(meta["encoder"])
    if fp != meta["encoder_sha256"]:
        raise HeadError(f"head {folder!r}: its encoder {meta['encoder']!r} changed since training (weights sha256 "
                        f"{fp[:12]}…, the head was trained on {meta['encoder_sha256'][:12]}…)")


class HeadScorer:
    """Scores texts with a head folder: the clipped regression score (`threads`: torch's CPU threads while
    scoring; the build's filter uses one per task, so a score does not depend on the machine's cores)."""

    kind = "embedding"

    def __init__(self, folder: str, batch_size: int = 32, threads: int | None = None):
        from safetensors.numpy import load_file

        self.path, self.threads = folder, threads
        self.meta = read_head_meta(folder)
        check_encoder(self.meta, folder)
        self.encoder = Encoder(self.meta["encoder"], self.meta["max_length"], batch_size)
        weights = load_file(os.path.join(folder, HEAD_WEIGHTS))
        self.w, self.b = weights["weight"].reshape(-1), float(weights["bias"][0])
        lo, hi = self.meta["score_range"]
        self.score_range = (float(lo), float(hi))
        self.default_threshold = float(self.meta["cut"])

    def raw(self, texts: list[str]) -> np.ndarray:
        with _threads(self.threads) if self.threads else contextlib.nullcontext():
            return self.encoder.embed(texts) @ self.w + np.float32(self.b)

    def score(self, texts: list[str]) -> list[float]:
        lo, hi = self.score_range
        return np.clip(self.raw(texts), lo, hi).astype(np.float64).tolist() if texts else []


def int_score(score: float) -> int:
    """FineWeb-Edu's integer score of a clipped score (halves round up)."""
    return int(math.floor(score + 0.5))
