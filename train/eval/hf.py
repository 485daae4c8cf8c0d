"""`train eval --hf FOLDER`: score multiple-choice items with a Hugging Face model folder through
transformers (e.g. one written by `train ckpt export`), the same way lm-evaluation-harness's HF backend
does: requests encoded by train.eval.requests (the folder's tokenizer.json through the `tokenizers`
library, so ids are those of the Megatron path), float32 model, log_softmax in float32, continuation
log-probs summed per candidate.

Candidates are sorted by length (longest first, as lm-eval does) and batched with right padding under a
token budget (rows × longest row ≤ batch_tokens), by the Megatron path's `length_batches`. Candidates whose
model inputs are identical (e.g. one-token continuations of a shared context) are run once. For Llama-like models only the hidden states at
continuation positions go through the output layer (the logits of a whole batch over a large vocabulary
would not fit in memory); others use the model's full logits.
"""
from __future__ import annotations

import json
import os

import torch

from storage import atomic
from storage.evaltasks import Task
from train.eval.requests import encode_items, task_metrics
from train.eval.scorer import length_batches
from train.generation.load import load_hf_model

# Models whose causal-LM head is exactly `lm_head(base_model(...).last_hidden_state)`.
_PLAIN_HEAD = {"llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "smollm3"}


def load_hf(folder: str):
    """(model in float32 eval mode, tokenizers.Tokenizer, eos id, max_length) for a HF folder."""
    from tokenizers import Tokenizer

    tok_path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise FileNotFoundError(f"{folder}: no tokenizer.json (export with a tokenizer: train ckpt export "
                                "--tokenizer PATH)")
    tok = Tokenizer.from_file(tok_path)
    model = load_hf_model(folder)
    cfg = model.config
    eos = cfg.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:  # an older export: EOS only in tokenizer_config.json, or not at all
        tc_path = os.path.join(folder, "tokenizer_config.json")
        name = None
        if os.path.isfile(tc_path):
            with open(tc_path) as f:
                name = json.load(f).get("eos_token")
        if isinstance(name, dict):
            name = name.get("content")
        eos = tok.token_to_id(name) if name else None
    if eos is None:
        raise ValueError(f"{folder}: no EOS token in config.json or tokenizer_config.json (needed as the "
                         "prefix of empty contexts); re-export it with `train ckpt export`")
    max_length = getattr(cfg, "max_position_embeddings", None) or 2048
    return model, tok, int(eos), int(max_length)


@torch.inference_mode()
def _score_inputs(model, inputs: list[list[int]], targets: list[list[list[int]]], pad_id: int,
                  batch_tokens: int) -> list[list[float]]:
    """For each distinct input row, the summed log-probs of each of its target continuations (the last
    len(target) positions of the row predict the target tokens)."""
    plain = getattr(model.config, "model_type", None) in _PLAIN_HEAD
    lengths = [len(x) for x in inputs]
    order = sorted(range(len(inputs)), key=lambda i: (-lengths[i], inputs[i]))
    out: list[list[float]] = [[] for _ in inputs]
    for rows in length_batches(order, lengths, batch_tokens):
        width = lengths[rows[0]]
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, :lengths[i]] = torch.tensor(inputs[i])
        if plain:
            hidden = model.base_model(input_ids=ids).last_hidden_state
            # positions needed per row: the last max(len(target)) ones before its padding
            span = [max(len(t) for t in targets[i]) for i in rows]
            sel = torch.cat([hidden[r, lengths[i] - n: lengths[i]] for r, (i, n) in enumerate(zip(rows, span))])
            logp = torch.log_softmax(model.get_output_embeddings()(sel).float(), dim=-1)
            starts = torch.tensor([0] + span).cumsum(0).tolist()
            per_row = [logp[starts[r]: starts[r + 1]] for r in range(len(rows))]
        else:
            logits = model(input_ids=ids).logits
            per_row = [torch.log_softmax(logits[r, :lengths[i]].float(), dim=-1) for r, i in enumerate(rows)]
        for r, i in enumerate(rows):
            lp = per_row[r]
            for t in targets[i]:
                pos = lp[lp.shape[0] - len(t):]
                out[i].append(float(pos.gather(1, torch.tensor(t).unsqueeze(1)).sum()))
    return out


def score_hf(folder: str, tasks: list[Task], batch_tokens: int = 16384) -> dict[str, dict]:
    """Per task: {"metrics": task_metrics(...), "item_ids", "logliks": per item per candidate summed
    continuation log-probs, "n_tokens": per item per candidate continuation token counts}."""
    model, tok, eos, max_length = load_hf(folder)
    # One model input per distinct token row; each request points to (row, which of its targets).
    rows: dict[tuple, int] = {}
    inputs: list[list[int]] = []
    targets: list[list[list[int]]] = []
    where: list[tuple[int, int, int, int, int]] = []  # (task, item, candidate, row, target in row)
    encoded = []
    for ti, task in enumerate(tasks):
        enc = encode_items(tok, task.items, max_length, eos)
        encoded.append(enc)
        for ii, cands in enumerate(enc):
            for ci, c in enumerate(cands):
                whole = c.context + c.continuation
                if len(c.continuation) >= len(whole):
                    raise ValueError(f"task {task.name} item {task.items[ii].item_id}: continuation of "
                                     f"{len(c.continuation)} tokens does not fit in {max_length} positions")
                key = tuple(whole[:-1])
                if key not in rows:
                    rows[key] = len(inputs)
                    inputs.append(list(key))
                    targets.append([])
                r = rows[key]
                where.append((ti, ii, ci, r, len(targets[r])))
                targets[r].append(c.continuation)
    scores = _score_inputs(model, inputs, targets, eos, batch_tokens)
    logliks = [[[0.0] * len(cands) for cands in enc] for enc in encoded]
    for ti, ii, ci, r, k in where:
        logliks[ti][ii][ci] = scores[r][k]
    out = {}
    for ti, task in enumerate(tasks):
        n_tokens = [[len(c.continuation) for c in cands] for cands in encoded[ti]]
        out[task.name] = {"metrics": task_metrics(task.items, logliks[ti], n_tokens, task.kind),
                          "item_ids": [it.item_id for it in task.items], "logliks": logliks[ti], "n_tokens": n_tokens}
    return out


def generate_hf(folder: str, specs: list[str], limit: int | None, gen, first: bool = False) -> dict[str, dict]:
    """Generative tasks (train.eval.generative) on a HF folder: per task its details (metrics, items with
    every generation). `gen`: an eval.generation section (GenerationEvalConfig)."""
    from train.eval.generative import GenerativeTask
    from train.generation.engine import Engine
    from train.generation.load import load

    model, tok, template, eos = load(folder)
    engine = Engine(model, tok, eos, backend=gen.backend, max_batch_size=gen.batch_size,
                    prompt_lookup=gen.prompt_lookup)
    out = {}
    for spec in specs:
        task = GenerativeTask(spec, limit, tok, max_length=model.config.max_position_embeddings, chat_template=template,
                              chat=gen.chat_template, max_new_tokens=gen.max_new_tokens, stop=gen.stop,
                              samples=gen.samples, temperature=gen.temperature, timeout_s=gen.timeout_s,
                              unsafe_exec=gen.unsafe_exec, first=first)
        _, details = task.run(engine)
        out[task.name] = {"generative": True, **details}
    return out


class HFScorer:
    """train.eval.scorer.Scorer's `score` for a transformers model: per row, its spans' summed target
    log-probs (float32 log_softmax, float64 sums), rows batched by `batch` with right padding."""

    def __init__(self, model, batch: int = 8):
        self.model, self.batch = model, batch

    @torch.inference_mode()
    def score(self, rows) -> list[list[float]]:
        out = []
        for b in range(0, len(rows), self.batch):
            chunk = rows[b:b + self.batch]
            width = max(len(r.tokens) for r in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, r in enumerate(chunk):
                ids[i, :len(r.tokens)] = torch.tensor(r.tokens)
                mask[i, :len(r.tokens)] = 1
            logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            for i, r in enumerate(chunk):
                lp = logp[i, :len(r.tokens)].gather(1, torch.tensor(r.labels).unsqueeze(1))[:, 0].double()
                out.append([float(lp[a:e].sum()) for a, e in r.spans])
        return out


def validation_hf(folder: str, dataset: str, seq_len: int, tokens: int) -> dict[str, float]:
    """`val/<source>/{loss,ppl,bpb,tokens}` of a HF folder on the dataset's held-out split: the same
    sequences as `train eval` of a checkpoint (train.eval.validation)."""
    from train.eval.validation import ValidationSet

    model, *_ = load_hf(folder)
    return ValidationSet.from_dataset(dataset, seq_len, tokens).evaluate(HFScorer(model))


def evaluate_hf(spec: str, config_path: str | None, overrides: list[str], task_list: list[str] | None,
                limit: int | None, validation_tokens: int | None, out: str | None) -> str:
    """`train eval --hf [LABEL=]FOLDER`: validation loss (when the config names a dataset), benchmarks,
    generative tasks, size on disk and (eval.generation.speed_prompts) generation speed of a HF folder.
    The record has the shape of a checkpoint's (train.eval.results), so `--table` shows both; written to
    OUT/<label or folder name>.json when OUT is a folder, to OUT when it ends with .json, else
    FOLDER/eval.json. Returns the lines to print."""
    import time

    from storage import config as cfgmod
    from storage.evaltasks import EARLY_SIGNAL
    from train.checkpoint.quantize import folder_bytes
    from train.config import TrainConfig
    from train.eval.config import load_mc_task
    from train.eval.generative import is_generative
    from train.eval.results import LABEL, write_result

    label, folder = None, spec
    if "=" in spec and not os.path.exists(spec):
        label, folder = spec.split("=", 1)
        if not LABEL.fullmatch(label):
            raise cfgmod.ConfigError(f"--hf {spec}: bad label {label!r} (letters, digits and _ . + -)")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"--hf {folder}: not a Hugging Face model folder (no config.json)")
    cfg = cfgmod.load(TrainConfig, config_path, overrides)
    ecfg = cfg.eval
    specs = task_list or ecfg.tasks or list(EARLY_SIGNAL)
    first = ecfg.limit_mode == "first"
    loaded = [load_mc_task(t, limit or ecfg.limit or 200, first) for t in specs if not is_generative(t)]
    gen_specs = [t for t in specs if is_generative(t)]
    ecfg.tasks = gen_specs
    ecfg.check_tasks()  # task files and the code tasks' sandbox checked before the model is loaded
    metrics: dict[str, float] = {}
    n_val = ecfg.validation_tokens if validation_tokens is None else validation_tokens
    if n_val and cfg.data.dataset and not cfg.debug.synthetic_data:
        metrics |= validation_hf(folder, cfg.data.dataset, cfg.data.seq_len, n_val)
    res = score_hf(folder, loaded) if loaded else {}
    for name, r in res.items():
        metrics |= {f"eval/{name}/{k}": v for k, v in r["metrics"].items()
                    if k in ("acc", "acc_norm", "acc_token", "bpb")}
    glimit = limit if limit is not None else (ecfg.generation.limit or ecfg.limit)
    res |= generate_hf(folder, gen_specs, glimit, ecfg.generation, first) if gen_specs else {}
    metrics["size_bytes"] = folder_bytes(folder)
    if ecfg.generation.speed_prompts:
        from train.eval.speed import generation_speed
        from train.generation.load import load

        m = load(folder)
        metrics["generation_tokens_per_s"] = generation_speed(m.model, m.tokenizer, ecfg.generation.speed_prompts,
                                                              ecfg.generation.speed_new_tokens)
    with open(os.path.join(folder, "config.json")) as f:
        src = json.load(f).get("smoltrain_checkpoint") or {}
    rec = {"checkpoint": os.path.basename(os.path.abspath(folder)), "path": os.path.abspath(folder),
           "hf_folder": os.path.abspath(folder), "step": src.get("step") or 0, "consumed_tokens": 0,
           "evaluated_at": time.time(), "metrics": metrics, "tasks": res}
    if label:
        rec = {"label": label, **rec}
    if out and not out.endswith(".json"):
        os.makedirs(out, exist_ok=True)
        path = write_result(out, rec)
    else:
        path = out or os.path.join(folder, "eval.json")
        atomic.write_bytes(path, json.dumps(rec, indent=1).encode())
    lines = [f"{k:<24} {v:.4f}" for k, v in metrics.items() if k.startswith("val/all/") or k.startswith("gen")]
    for name, r in res.items():
        m = r["metrics"]
        lines.append(f"{name:<16} " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()
                                                if k != "items" and isinstance(v, (int, float)))
                     + f"  ({m.get('items', '?')} items)")
    lines.append(f"size on disk {metrics['size_bytes'] / 2**20:.2f} MiB; wrote {path}")
    return "\n".join(lines)
