"""The generation engine (train.generation.engine) on the tiny Llama of tests/train/conftest.py: greedy output
of every CPU backend equals transformers' `generate` at batch size 1 (vocabulary padding rows suppressed)
on 36 prompts of 1 to 70 tokens
(batches of 8, so left padding varies within a batch), stop strings end a sequence at the token that
completes them, stop tokens are kept, rows that end leave the batch without changing the others, sampling repeats with its seed and returns the log-probs the model
gives its tokens, vocabulary padding rows are never generated, speculative decoding with a draft gives the
target's greedy output, a prefix the prompts share is run once without changing the output, and the
Megatron model in memory (TP=2) mirrors into the same transformers model."""
from __future__ import annotations

import pytest
import torch

from testutil import read_corpus

N_NEW = 20


@pytest.fixture(scope="module")
def setup(tiny_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_hf[0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    stream = tok(" ".join(d["text"] for d in read_corpus("fortunes", 200)), add_special_tokens=False)["input_ids"]
    prompts = [stream[i * 37: i * 37 + 1 + (i * 23) % 70] for i in range(36)]  # 36 lengths, 1 to 70 tokens
    eos = [tok.eos_token_id]
    assert model.config.vocab_size > len(tok)  # padding rows, never generated (the engine's rule)
    ref = [greedy_one(model, tok, eos, ids, N_NEW) for ids in prompts]
    return model, tok, prompts, ref, eos


def greedy_one(model, tok, eos: list[int], ids: list[int], n_new: int) -> list[int]:
    """transformers' greedy `generate` at batch size 1, vocabulary padding rows suppressed: the reference."""
    from transformers import GenerationConfig

    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(
            max_new_tokens=n_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
            suppress_tokens=list(range(len(tok), model.config.vocab_size))))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("backend,lookup", [("padded", 0), ("padded", 6), ("continuous", 0)])
def test_greedy_equals_generate_at_batch_size_1(setup, backend, lookup):
    from train.generation.engine import Engine, SamplingParams

    model, tok, prompts, ref, eos = setup
    assert len({len(p) for p in prompts}) > 20 and min(map(len, prompts)) == 1
    eng = Engine(model, tok, eos, backend=backend, max_batch_size=8, prompt_lookup=lookup)
    got = eng.generate(prompts, SamplingParams(max_new_tokens=N_NEW))
    assert [c[0].token_ids for c in got] == ref
    if lookup:  # guesses were checked, some kept, some not
        st = eng.lookup_stats
        assert 0 < st.accepted < st.proposed and st.forwards < len(prompts) * (N_NEW - 1) / 8, st
    assert all(c[0].finish_reason == ("stop" if r[-1] in eos else "length") for c, r in zip(got, ref, strict=True))


@pytest.mark.parametrize("backend,lookup", [("padded", 0), ("padded", 6), ("continuous", 0)])
def test_stop_strings_and_stop_tokens(setup, backend, lookup):
    from train.generation.engine import Engine, SamplingParams

    model, tok, prompts, ref, eos = setup
    eng = Engine(model, tok, eos, backend=backend, max_batch_size=8, prompt_lookup=lookup)
    # a stop string taken from the middle of prompt 3's greedy continuation: it ends there, and only there
    r = ref[3]
    stop = tok.decode(r[6:8])
    cut = next(k for k in range(1, len(r) + 1) if stop in tok.decode(r[:k]))
    assert cut <= 8
    got = eng.generate([prompts[3], prompts[4]], SamplingParams(max_new_tokens=N_NEW, stop=(stop,)))
    assert got[0][0].token_ids == r[:cut] and got[0][0].finish_reason == "stop"
    other = ref[4]
    k4 = next((k for k in range(1, len(other) + 1) if stop in tok.decode(other[:k])), len(other))
    assert got[1][0].token_ids == other[:k4]
    # a stop token is generated and kept as the last token
    tid = r[5]
    got = eng.generate([prompts[3]], SamplingParams(max_new_tokens=N_NEW, stop_token_ids=(tid,)))
    assert got[0][0].token_ids == r[:r.index(tid) + 1] and got[0][0].finish_reason == "stop"


def test_sampling_repeats_with_its_seed_and_returns_the_models_log_probs(setup):
    from train.generation.engine import Engine, SamplingParams

    model, tok, prompts, _, eos = setup
    eng = Engine(model, tok, eos, backend="padded", max_batch_size=8)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, n=4, seed=7, logprobs=True)
    a = eng.generate(prompts[:5], params)
    b = eng.generate(prompts[:5], params)
    c = eng.generate(prompts[:5], SamplingParams(**{**params.__dict__, "seed": 8}))
    assert all(len(x) == 4 for x in a)
    assert [[s.token_ids for s in x] for x in a] == [[s.token_ids for s in x] for x in b]
    assert [[s.token_ids for s in x] for x in a] != [[s.token_ids for s in x] for x in c]
    assert len({tuple(s.token_ids) for s in a[2]}) > 1  # the n samples of a prompt differ
    # the engine's log-probs are those of the model's logits / temperature at each sampled token
    for p, s in ((prompts[1], a[1][0]), (prompts[4], a[4][3])):
        x = torch.tensor([p + s.token_ids])
        with torch.no_grad():
            logits = model(x).logits[0, len(p) - 1:-1].float() / 0.8
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4)


@pytest.mark.parametrize("backend", ["padded", "continuous"])
def test_sampled_tokens_follow_the_temperature_and_top_p_distribution(setup, backend):
    """4,000 first tokens sampled at temperature 0.7, top-p 0.8 against the model's own distribution there:
    softmax(logits / 0.7), cut to the smallest set of most likely tokens whose mass reaches 0.8, renormalised
    (a sampler ignoring the temperature or the top-p, or sampling the padding rows, fails the chi-square test or
    draws a token outside the set)."""
    from scipy.stats import chisquare

    from train.generation.engine import Engine, SamplingParams

    model, tok, prompts, _, eos = setup
    prompt, n = prompts[20], 4000
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1, :len(tok)].double()
    p = torch.softmax(logits / 0.7, -1)
    order = torch.argsort(p, descending=True)
    keep = order[:int((torch.cumsum(p[order], 0) < 0.8).sum()) + 1]
    want = torch.zeros_like(p)
    want[keep] = p[keep] / p[keep].sum()
    assert 5 <= len(keep) <= len(tok) // 2  # a cut that matters, and a mass spread over several tokens
    eng = Engine(model, tok, eos, backend=backend, max_batch_size=500)
    got = eng.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.7, top_p=0.8, n=n, seed=3))[0]
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in got]), minlength=len(p)).double()
    assert counts[want == 0].sum() == 0, "a token outside the top-p set was sampled"
    big = want * n >= 5  # chi-square bins: every kept token expected 5+ times, the rest of the set pooled
    obs = torch.cat([counts[big], counts[(want > 0) & ~big].sum().reshape(1)])
    exp = torch.cat([want[big] * n, (want[(want > 0) & ~big] * n).sum().reshape(1)])
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3, (obs.tolist(), exp.tolist())


def test_rows_that_end_leave_the_batch_and_change_nothing(setup, monkeypatch):
    """Decoded in chunks of 8 steps, rows that ended (a stop token) leave the batch between chunks: every row's
    greedy output is still its batch-size-1 output cut at the stop token, and rows did end at different chunks."""

    from train.generation import engine as E

    model, tok, prompts, _, eos = setup
    monkeypatch.setattr(E, "CHUNK", 8)
    n_new, chosen = 40, prompts[:16]
    free = [greedy_one(model, tok, eos, ids, n_new) for ids in chosen]
    counts: dict[int, int] = {}
    for r in free:
        for t in set(r[:20]):
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=lambda t: (counts[t] < len(free), counts[t]))  # in many rows' first 20, not all
    want = [r[:r.index(stop) + 1] if stop in r else r for r in free]
    ends = {len(w) for w in want if w[-1] == stop}
    assert min(ends) <= 8 < max(len(w) for w in want) and len(ends) > 1
    got = E.Engine(model, tok, eos, backend="padded", max_batch_size=16).generate(
        chosen, E.SamplingParams(max_new_tokens=n_new, stop_token_ids=(stop,)))
    assert [c[0].token_ids for c in got] == want
    assert [c[0].finish_reason for c in got] == ["stop" if w[-1] in (stop, *eos) else "length" for w in want]


def test_a_shared_prefix_is_run_once_and_changes_nothing(setup):
    """Prompts sharing a long prefix (few-shot exemplars): the padded backend runs it once into a cache laid
    out [prefix][padding][rest]; greedy output still equals generate at batch size 1, and sampled log-probs
    are still the model's."""

    from train.generation.engine import Engine, SamplingParams
    from train.generation.kv_cache import SHARED_PREFIX, prefilled_cache

    model, tok, prompts, _, eos = setup
    head = [t for p in prompts[20:] for t in p][:SHARED_PREFIX + 9]
    shared = [head + prompts[i][:1 + i % 11] for i in range(12)]  # rests of 1 to 11 tokens
    ref = [greedy_one(model, tok, eos, ids, N_NEW) for ids in shared]
    eng = Engine(model, tok, eos, backend="padded", max_batch_size=8)
    ids, mask, cache = prefilled_cache(model, shared[:8], N_NEW, eng._pad_id())
    assert cache.get_seq_length() == len(head) and mask[:, :len(head)].all()
    assert [c[0].token_ids for c in eng.generate(shared, SamplingParams(max_new_tokens=N_NEW))] == ref
    s = eng.generate(shared[3:4] * 2, SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, logprobs=True))[0][0]
    x = torch.tensor([shared[3] + s.token_ids])
    with torch.no_grad():
        logits = model(x).logits[0, len(shared[3]) - 1:-1].float() / 0.8
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4)


def test_prompt_lookup_gives_the_greedy_output_and_the_models_log_probs(setup):
    """Prompt-lookup speculative decoding (train.generation.ngram) on prompts that repeat themselves, so most
    guesses are kept: rows move on by different numbers of tokens per step, rows that end (a stop token)
    leave, a shared prefix is run once; tokens equal generate at batch size 1 and log-probs are the model's."""
    from train.generation.engine import Engine, SamplingParams
    from train.generation.kv_cache import SHARED_PREFIX

    model, tok, prompts, ref, eos = setup
    head = [t for p in prompts[20:] for t in p][:SHARED_PREFIX + 4]
    loops = [(prompts[i][:3 + i % 9] * 4)[: 5 + 3 * i] for i in range(12)] + [head + prompts[i][:6] * 2 for i in range(4)]
    n_new = 40
    want = [greedy_one(model, tok, eos, ids, n_new) for ids in loops]
    counts: dict[int, int] = {}
    for w in want:
        for t in set(w[5:30]):
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=lambda t: (counts[t] < len(want) - 2, counts[t]))  # a stop token many rows reach
    want = [w[:w.index(stop) + 1] if stop in w else w for w in want]
    assert 1 < sum(w[-1] == stop for w in want) < len(want)
    eng = Engine(model, tok, eos, backend="padded", max_batch_size=16, prompt_lookup=8)
    got = eng.generate(loops, SamplingParams(max_new_tokens=n_new, stop_token_ids=(stop,), logprobs=True))
    assert [c[0].token_ids for c in got] == want
    st = eng.lookup_stats
    assert st.accepted > st.proposed / 2 and st.forwards < n_new * 0.7, st  # several tokens per forward
    for p, c in zip(loops[::5], got[::5], strict=True):
        x = torch.tensor([p + c[0].token_ids])
        with torch.no_grad():
            logits = model(x).logits[0, len(p) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(c[0].token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(c[0].logprobs), lp, atol=1e-4)


def test_lookup_guesses_follow_the_longest_match_at_its_first_occurrence():
    from train.generation.ngram import Lookup

    look = Lookup([1, 2, 5, 8, 1, 2, 6, 8, 1, 2])
    assert look.propose(3) == [6, 8, 1]          # (8, 1, 2) beats (1, 2), whose first continuation is 5
    look.extend([4])
    assert look.propose(5) == []                 # (2, 4) and (4,) never occurred before
    look.extend([1, 2])
    assert look.propose(2) == [5, 8]             # (4, 1, 2) never occurred: (1, 2) at its first occurrence
    assert Lookup([7]).propose(4) == [] and Lookup([7, 7]).propose(3) == [7]


def test_vocabulary_padding_rows_are_never_generated(setup):
    from transformers import AutoModelForCausalLM

    from train.generation.engine import Engine, SamplingParams

    model, tok, prompts, _, eos = setup
    n = len(tok)
    big = AutoModelForCausalLM.from_config(model.config.__class__(**{**model.config.to_dict(), "vocab_size": n + 64}))
    with torch.no_grad():
        for name, p in model.state_dict().items():
            big.state_dict()[name][: p.shape[0]].copy_(p)
        big.get_output_embeddings().weight[n:] = big.get_output_embeddings().weight[:64] * 50  # rows that would win
    eng = Engine(big.eval(), tok, eos, backend="padded", max_batch_size=8)
    for params in (SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)):
        got = eng.generate(prompts[:8], params)
        assert all(t < n for c in got for t in c[0].token_ids)


def test_speculative_decoding_gives_the_targets_greedy_output(setup):
    from transformers import AutoModelForCausalLM

    from train.generation.engine import SamplingParams
    from train.generation.load import Loaded
    from train.generation.speculative import assisted

    model, tok, prompts, ref, eos = setup
    torch.manual_seed(1)
    draft = AutoModelForCausalLM.from_config(model.config.__class__(**{**model.config.to_dict(),
                                                                       "num_hidden_layers": 1})).eval()
    with torch.no_grad():  # a draft that agrees often: the target's embeddings and first layer
        for name, p in draft.state_dict().items():
            p.copy_(model.state_dict()[name])
    stats = []
    for i in (2, 9, 20):
        c = assisted(Loaded(model, tok, None, eos), Loaded(draft, tok, None, eos), prompts[i],
                     SamplingParams(max_new_tokens=N_NEW), stats)
        assert c.token_ids == ref[i]
    assert all(0.0 < s.acceptance <= 1.0 and s.new_tokens == N_NEW for s in stats), stats


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the vLLM backend needs a CUDA GPU (and the vllm package)")
def test_vllm_backend_matches_transformers(setup):
    pytest.importorskip("vllm", reason="the vLLM backend needs the vllm package")
    from train.generation.engine import Engine, SamplingParams

    model, tok, prompts, ref, eos = setup
    got = Engine(model.cuda(), tok, eos, backend="vllm").generate(prompts, SamplingParams(max_new_tokens=N_NEW))
    assert [c[0].token_ids for c in got] == ref


def test_stop_strings_are_looked_for_only_after_tokens_that_can_complete_them():
    """The engine decodes a row's tail only after a token that can complete a stop string
    (`completing_tokens`): on random sequences of a byte-level BPE (partial UTF-8 characters, special tokens,
    multi-byte and ASCII stop strings) every prefix ends exactly where decoding after every token says."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from train.generation.engine import StopChecker, completing_tokens

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [d["text"] for d in read_corpus("fortunes", 100)] + ["Q: 中文的句子。A: é! 😀 </s> 日本語です。"] * 20
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=420, special_tokens=["<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    stops = ("Q:", "</s>", "<|im_end|>", "。", "é!", "😀")
    completing = completing_tokens(tok, stops)
    assert completing is not None and 0 < sum(completing) < len(tok) // 2  # most tokens skip the decode
    assert completing_tokens(tok, ("\n\n",)) is None  # a stop string ending in whitespace: decode always
    filtered, every = StopChecker(tok, set(), stops, completing), StopChecker(tok, set(), stops)
    rng = random.Random(0)
    special = tok.convert_tokens_to_ids("<|im_end|>")
    seqs = [[rng.choice([special] + list(range(len(tok)))) for _ in range(40)] for _ in range(150)]
    first_end = []  # a sequence stops at its first end: only prefixes up to there are ever checked
    for seq in seqs:
        k = next((k for k in range(1, len(seq) + 1) if every.end(seq[:k]) is not None), len(seq) + 1)
        first_end.append(k)
        for j in range(1, min(k, len(seq)) + 1):
            assert filtered.end(seq[:j]) == every.end(seq[:j]), (seq[:j], tok.decode(seq[:j]))
    batch = torch.tensor(seqs)
    for k in range(1, 41):
        rows = [r for r in range(0, 150, 2) if first_end[r] >= k]
        assert filtered.ended(batch[:, :k], rows) == every.ended(batch[:, :k], rows)
    ends = sum(k <= 40 for k in first_end)
    assert ends > 30  # the sequences do reach stop strings, multi-byte ones included
