"""The one generation engine: `train generate`, generative evaluation and RL rollouts all call
`Engine.generate(prompts, SamplingParams)` on token ids and get `Completion`s back.

Backends (`backend`):
- `continuous`: transformers' continuous batching (the manager behind `generate_batch`): requests join and
  leave the running batch as they start and finish, prompt blocks shared between requests with a common
  prefix (few-shot prompts) are computed once, KV cache in pages. Stop strings, which it does not know,
  are watched on the streamed tokens here and the request is cancelled.
- `padded`: transformers' `generate` on batches of prompts sorted by length, left-padded, with a static
  KV cache (preallocated: no copy of the growing cache at every step, as the default dynamic cache does)
  whose layers give attention only their filled positions (no mask at all for unpadded rows of one
  length), and a stopping criterion per row (EOS ids and stop strings); the cache is
  `train.generation.kv_cache`. It decodes CHUNK steps per `generate` call and continues from the cache;
  rows that ended leave the batch in between (their cache rows dropped), so a few long answers do not keep
  a whole batch of finished rows computing. When a batch's prompts share a prefix of at least
  SHARED_PREFIX tokens (few-shot exemplars, a system prompt, an RL group's copies of one prompt), the
  prefix is run once and copied into every row's cache; rows are laid out as [prefix][padding][rest of
  the prompt] (the attention mask and the positions skip the padding), and `generate` runs on from there.
  With `prompt_lookup` > 0, greedy batches decode after `generate`'s prefill by prompt-lookup speculative
  decoding (train.generation.ngram): every step checks up to that many tokens per row guessed from the
  row's own n-grams, lossless.
- `vllm`: vLLM's `LLM` on a GPU, its weights handed over from ours (`load_weights`), never downloaded.
`auto` picks vLLM when it is installed and a GPU is present, else `continuous` on a GPU when the installed
transformers has it, else `padded`: on CPU, transformers' paged attention made continuous batching 5.3x
slower than a padded batch of 32 (32 prompts, 48 new tokens, the demo model; docs/benchmarks.md; 8x before
its page cache was sized from the requests).

Semantics shared by every backend: a sequence ends at one of `eos_ids` / `stop_token_ids` (kept as its
last token) or once its decoded text (special tokens kept, as lm-eval's stopping criterion decodes it)
contains a stop string (tokens up to the one that completed it are kept), or after `max_new_tokens`.
Token ids the tokenizer does not have (vocabulary padding rows) are never generated. Greedy output equals
transformers' `generate` at batch size 1 on the same weights (tests/train/test_generation_engine.py).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from train.generation import ngram
from train.generation.kv_cache import keep_rows, prefilled_cache
from train.model.cpu_compat import suspended

BACKENDS = ("auto", "continuous", "padded", "vllm")
CHUNK = 32          # padded backend: decode steps between two looks at which rows ended (they leave the batch)


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0             # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0: off
    n: int = 1                           # completions per prompt
    seed: int = 0                        # sampling seed (one generation call is reproducible for a given backend)
    stop: tuple[str, ...] = ()           # stop strings
    stop_token_ids: tuple[int, ...] = ()  # stop tokens besides the engine's EOS ids
    logprobs: bool = False               # also return each generated token's log-prob (of logits / temperature)


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str                   # "stop" (a stop token or string) or "length"
    logprobs: list[float] | None = None


@dataclass
class StopChecker:
    """Where a sequence ends: at a stop token, or at the token that completes a stop string in its text.
    `completing` (from `completing_tokens`): per token id, whether it can complete a stop string; the text is
    decoded only after such a token (None: after every token)."""
    tokenizer: object
    stop_ids: set[int]
    stops: tuple[str, ...] = ()
    completing: list[bool] | None = None
    window: int = field(init=False, default=0)

    def __post_init__(self):
        # a stop string of c characters lies within the last c + 1 tokens that complete it
        self.window = max((len(s) for s in self.stops), default=0) + 2

    def _may_complete(self, token: int) -> bool:
        return self.completing is None or token >= len(self.completing) or self.completing[token]

    def end(self, tokens: list[int]) -> int | None:
        """Tokens to keep if `tokens` (a growing sequence) has ended at its last token, else None."""
        if not tokens:
            return None
        if tokens[-1] in self.stop_ids:
            return len(tokens)
        if self.stops and self._may_complete(tokens[-1]):
            tail = self.tokenizer.decode(tokens[-self.window:], skip_special_tokens=False)
            if any(s in tail for s in self.stops):
                return len(tokens)
        return None

    def ended(self, generated: torch.Tensor, rows: list[int]) -> list[bool]:
        """Whether each of `rows` of `generated` ([batch, tokens so far], at least one) ended at its last token:
        `end` for a whole batch, the tails that need it decoded in one call."""
        last = generated[rows, -1].tolist()
        done = [t in self.stop_ids for t in last]
        check = [k for k, t in enumerate(last) if not done[k] and self._may_complete(t)] if self.stops else []
        if check:
            tails = generated[[rows[k] for k in check], -self.window:].tolist()
            rust = getattr(self.tokenizer, "backend_tokenizer", None)
            if rust is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
                tails = rust.decode_batch(tails, skip_special_tokens=False)  # (what decode returns, minus its overhead)
            else:
                tails = self.tokenizer.batch_decode(tails, skip_special_tokens=False)
            for k, text in zip(check, tails, strict=True):
                done[k] = any(s in text for s in self.stops)
        return done


def completing_tokens(tokenizer, stops: tuple[str, ...]) -> list[bool] | None:
    """Per token id, whether appending it can complete one of `stops` in the decoded text: a stop string not
    there before ends inside the new token's text, so that text (decoded alone) holds the string's last
    character, or an incomplete character (U+FFFD: its bytes may complete one that the token before began).
    None (decode after every token) when a stop string ends in whitespace, which some decoders drop from a
    token decoded alone (a leading metaspace)."""
    if not stops or any(s[-1].isspace() for s in stops):
        return None
    lasts = {s[-1] for s in stops}
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return ["\ufffd" in t or any(c in t for c in lasts) for t in texts]


class Engine:
    def __init__(self, model, tokenizer, eos_ids: list[int], *, backend: str = "auto", max_batch_size: int = 64,
                 prompt_lookup: int = 0):
        if backend not in BACKENDS:
            raise ValueError(f"generation backend {backend!r}: one of {', '.join(BACKENDS)}")
        if prompt_lookup < 0:
            raise ValueError(f"prompt_lookup must be >= 0 (guessed tokens per step), got {prompt_lookup}")
        self.prompt_lookup, self.lookup_stats = prompt_lookup, ngram.Stats()
        self.model, self.tokenizer, self.eos_ids = model.eval(), tokenizer, list(eos_ids)
        self.max_batch_size = max_batch_size
        self.backend = resolve_backend(backend, model)
        self._vllm = None
        self._completing: dict[tuple[str, ...], list[bool] | None] = {}  # completing_tokens per stop strings
        self._mask_vocab_padding()

    # ---------------------------------------------------------------- public
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions for each prompt (token ids), in prompt order."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt encodes to no tokens")
        flat = [p for p in prompts for _ in range(params.n)]
        stops = tuple(params.stop)
        if stops not in self._completing:
            self._completing[stops] = completing_tokens(self.tokenizer, stops)
        checker = StopChecker(self.tokenizer, set(self.eos_ids) | set(params.stop_token_ids), stops,
                              self._completing[stops])
        run = {"continuous": self._continuous, "padded": self._padded, "vllm": self._vllm_generate}[self.backend]
        with suspended():  # (in a trainer's process on CPU: megatron's CUDA→CPU shim is not needed here)
            done = run(flat, params, checker)
        return [done[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """New weights (HF names), e.g. the trainer's after an optimizer step."""
        if self._vllm is not None:
            _vllm_load(self._vllm, state_dict)
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise ValueError(f"weights do not fit the model (missing {missing}, unexpected {unexpected})")

    # ---------------------------------------------------------------- backends
    def _generation_config(self, params: SamplingParams, **extra):
        from transformers import GenerationConfig

        kw = dict(max_new_tokens=params.max_new_tokens, eos_token_id=sorted(
            set(self.eos_ids) | set(params.stop_token_ids)) or None, pad_token_id=self._pad_id())
        if params.temperature > 0:
            # top_k 0 turns transformers' top-k off: None would leave its default (50) in place, sampling from
            # the 50 likeliest tokens whatever top_p says
            kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        else:
            kw.update(do_sample=False)
        return GenerationConfig(**{**kw, **extra})

    def _padded(self, prompts: list[list[int]], params: SamplingParams, checker: StopChecker) -> list[Completion]:
        out: list[Completion | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # as lm-eval: longest first
        for b, start in enumerate(range(0, len(order), self.max_batch_size)):
            rows = order[start:start + self.max_batch_size]
            if params.temperature > 0:
                torch.manual_seed(params.seed * 1_000_003 + b)
            for i, c in zip(rows, self._padded_batch([prompts[i] for i in rows], params, checker), strict=True):
                out[i] = c
        return out

    def _padded_batch(self, prompts: list[list[int]], params: SamplingParams, checker: StopChecker) -> list[Completion]:
        """One batch, decoded CHUNK steps at a time; after each chunk the rows that ended leave the batch (their
        cache rows dropped), so a few long answers do not keep every finished row in the computation. Greedy
        with `prompt_lookup`: `_lookup_batch` instead."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        if self.prompt_lookup and params.temperature == 0 and ngram.supported(self.model):
            return self._lookup_batch(prompts, params, checker)
        ids, mask, cache = prefilled_cache(self.model, prompts, params.max_new_tokens, self._pad_id())
        start = ids.shape[1]  # generated tokens begin here in every row
        toks: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        ended = [False] * len(prompts)
        alive, left = list(range(len(prompts))), params.max_new_tokens
        while alive and left > 0:
            width, stop_at = ids.shape[1], {}  # alive position → tokens of this chunk it keeps

            class _Stop(StoppingCriteria):
                def __call__(self, input_ids, scores, **kwargs):
                    n = input_ids.shape[1] - width
                    open_rows = [j for j in range(len(alive)) if j not in stop_at]
                    if open_rows and n > 0:
                        for j, done in zip(open_rows, checker.ended(input_ids[:, start:], open_rows), strict=True):
                            if done:
                                stop_at[j] = n
                    return torch.tensor([j in stop_at for j in range(len(alive))])

            step = left if left <= CHUNK * 3 // 2 else CHUNK
            gen = self._generation_config(params, max_new_tokens=step, return_dict_in_generate=True,
                                          output_logits=params.logprobs)
            with torch.no_grad():
                res = self.model.generate(ids, attention_mask=mask, generation_config=gen, cache=cache,
                                          stopping_criteria=StoppingCriteriaList([_Stop()]))
            new = res.sequences[:, width:]
            for j, r in enumerate(alive):
                k = stop_at.get(j, new.shape[1])
                toks[r] += new[j, :k].tolist()
                ended[r] = j in stop_at
                if params.logprobs and k:
                    steps = torch.stack([lg[j] for lg in res.logits[:k]]).float()
                    lps[r] += torch.log_softmax(steps / (params.temperature or 1.0), -1).gather(
                        1, new[j, :k, None]).squeeze(1).tolist()
            left -= new.shape[1]
            keep = [j for j in range(len(alive)) if j not in stop_at]
            if not keep or left <= 0:
                break
            mask = torch.cat([mask, torch.ones(mask.shape[0], new.shape[1], dtype=mask.dtype)], 1)
            ids = res.sequences
            if len(keep) < len(alive):
                alive, ids, mask = [alive[j] for j in keep], ids[keep], mask[keep]
                cache = keep_rows(cache, keep, self.model.config)
        return [Completion(toks[r], "stop" if ended[r] else "length", lps[r] if params.logprobs else None)
                for r in range(len(prompts))]

    def _lookup_batch(self, prompts: list[list[int]], params: SamplingParams, checker: StopChecker) -> list[Completion]:
        """One greedy batch with prompt-lookup speculative decoding (train.generation.ngram) after `generate`'s
        prefill and first token."""
        k = self.prompt_lookup
        ids, mask, cache = prefilled_cache(self.model, prompts, params.max_new_tokens + k + 1, self._pad_id())
        gen = self._generation_config(params, max_new_tokens=1, return_dict_in_generate=True,
                                      output_logits=params.logprobs)
        with torch.no_grad():
            res = self.model.generate(ids, attention_mask=mask, generation_config=gen, cache=cache)
        first = res.sequences[:, -1]
        lps = torch.log_softmax(res.logits[0].float(), -1).gather(1, first[:, None]).squeeze(1).tolist() \
            if params.logprobs else None
        out = ngram.decode(self.model, prompts, mask, cache, first.tolist(), lps, params, checker, k, self._pad_id(),
                           self.lookup_stats)
        return [Completion(t, "stop" if e else "length", lp) for t, e, lp in out]

    def _continuous(self, prompts: list[list[int]], params: SamplingParams, checker: StopChecker) -> list[Completion]:
        from transformers import ContinuousBatchingConfig

        # transformers sizes the paged cache from free memory when num_blocks is unset: on CPU that allocates
        # gigabytes per call (about 20 s on 2 cores); the longest `max_batch_size` requests bound what it holds.
        sizing = {}
        if self.model.device.type == "cpu":
            longest = sorted((len(p) + params.max_new_tokens for p in prompts), reverse=True)[:self.max_batch_size]
            page = ContinuousBatchingConfig.page_size
            sizing["num_blocks"] = sum(-(-n // page) for n in longest) + 1
        cb = ContinuousBatchingConfig(return_logprobs=params.logprobs, seed=params.seed,
                                      max_requests_per_batch=self.max_batch_size, **sizing)
        gen = self._generation_config(params)
        watch = bool(checker.stops)
        out: dict[str, Completion] = {}
        if params.temperature > 0:
            torch.manual_seed(params.seed)
        with self.model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                            block=True, timeout=60, warmup=False) as manager:
            ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=params.max_new_tokens,
                                       streaming=watch) for i, p in enumerate(prompts)]
            pending = set(ids)
            while pending:
                res = manager.get_result(timeout=5)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError(f"continuous batching stopped with {len(pending)} requests unfinished")
                    continue
                rid = res.request_id
                if rid not in pending:
                    continue  # a cancelled request's later outputs
                if res.error is not None:
                    raise RuntimeError(f"generation of request {rid} failed: {res.error}")
                toks = list(res.generated_tokens)
                keep = checker.end(toks) if watch else None
                if keep is None and not res.is_finished():
                    continue
                if keep is not None and not res.is_finished():
                    manager.cancel_request(rid)
                n = keep if keep is not None else len(toks)
                stopped = keep is not None or (toks and toks[-1] in checker.stop_ids)
                out[rid] = Completion(toks[:n], "stop" if stopped else "length",
                                      list(res.logprobs[:n]) if params.logprobs else None)
                pending.discard(rid)
        return [out[i] for i in ids]

    def _vllm_generate(self, prompts: list[list[int]], params: SamplingParams, checker: StopChecker) -> list[Completion]:
        from vllm import SamplingParams as VP

        if self._vllm is None:
            self._vllm = _vllm_engine(self.model, self.tokenizer)
        vp = VP(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
                max_tokens=params.max_new_tokens, seed=params.seed, stop=list(params.stop) or None,
                stop_token_ids=sorted(checker.stop_ids), include_stop_str_in_output=True,
                logprobs=0 if params.logprobs else None, skip_special_tokens=False)
        outs = self._vllm.generate([{"prompt_token_ids": p} for p in prompts], vp, use_tqdm=False)
        done = []
        for o in outs:
            c = o.outputs[0]
            lp = [next(iter(d.values())).logprob for d in c.logprobs] if params.logprobs else None
            done.append(Completion(list(c.token_ids), "length" if c.finish_reason == "length" else "stop", lp))
        return done

    # ---------------------------------------------------------------- helpers
    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    def _mask_vocab_padding(self) -> None:
        """Logits of ids past the tokenizer's vocabulary (embedding rows padded for fast GEMMs) → -inf."""
        n = len(self.tokenizer)
        head = self.model.get_output_embeddings()
        if head is None or head.weight.shape[0] <= n or getattr(head, "_smoltrain_vocab", None) == n:
            return

        def hook(_module, _inputs, logits):
            logits[..., n:] = float("-inf")
            return logits
        head.register_forward_hook(hook)
        head._smoltrain_vocab = n


def resolve_backend(backend: str, model) -> str:
    if backend == "vllm" and not (importlib.util.find_spec("vllm") and torch.cuda.is_available()):
        raise ValueError("generation backend vllm needs the vllm package and a CUDA GPU (pip install vllm)")
    if backend != "auto":
        return backend
    if importlib.util.find_spec("vllm") and torch.cuda.is_available():
        return "vllm"
    on_gpu = next(model.parameters()).is_cuda
    return "continuous" if on_gpu and hasattr(model, "continuous_batching_context_manager") else "padded"


def _vllm_engine(model, tokenizer):
    """A vLLM engine with our model's weights: its config and tokenizer written to a local folder with
    the weights, so vLLM builds the same architecture; nothing is downloaded."""
    import tempfile

    from vllm import LLM

    folder = tempfile.mkdtemp(prefix="smoltrain-vllm-")
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return LLM(model=folder, tokenizer=folder, dtype=str(model.dtype).removeprefix("torch."),
               gpu_memory_utilization=0.3, enable_prefix_caching=True, seed=0)


def _vllm_load(llm, state_dict: dict[str, torch.Tensor]) -> None:
    """Hand new weights to a running vLLM engine (its model's `load_weights`, as TRL's colocated mode does)."""
    items = list(state_dict.items())
    if hasattr(llm, "collective_rpc"):
        llm.collective_rpc(lambda self: self.model_runner.model.load_weights(weights=items))
    else:
        llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(items)
