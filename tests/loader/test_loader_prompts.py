"""PromptLoader: every prompt once per epoch and equal to iter_prompts, epochs permuted afresh, a global order
independent of the DP size, exact resume with another DP size; the SFT loader skips prompts; doc_meta in
the shard format."""
from __future__ import annotations

import json

import numpy as np
import pytest

from storage.dataset import SourceWriter
from storage.loader import LoaderConfig
from storage.loader.conversations import ConversationLoader
from storage.loader.prompts import PromptLoader, iter_prompts
from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest
from storage.shards import ShardError, ShardReader, decode_block

EOS = 0


def make_prompts_dataset(root: str, prompts: dict[str, int], text_docs: int = 20, seed: int = 0) -> None:
    """Prompts sources (name → prompts of 3..60 tokens; every third without an answer, every fifth with
    extra fields), one text source, and a held-out split of the first prompts source, as datapipe writes them."""
    rng = np.random.default_rng(seed)
    infos, val = {}, {}

    def write(w: SourceWriter, name: str, i: int) -> None:
        meta = {} if i % 3 == 0 else {"answer": str(i * 7)}
        if i % 5 == 0:
            meta["extra"] = {"level": i % 4}
        w.add_document(f"{name}/q{i}", rng.integers(1, 60_000, int(rng.integers(3, 61))), meta=meta)

    for name, n in prompts.items():
        w = SourceWriter(root, name, "uint16", block_tokens=200, shard_blocks=3, kind="prompts")
        for i in range(n):
            write(w, name, i)
        infos[name] = w.close()
    for first in list(prompts)[:1]:
        w = SourceWriter(root, first, "uint16", block_tokens=200, prefix="validation", kind="prompts")
        for i in range(1000, 1007):
            write(w, first, i)
        val[first] = w.close()
    w = SourceWriter(root, "web", "uint16", block_tokens=200)
    for i in range(text_docs):
        w.add_document(f"web/{i}", np.append(rng.integers(1, 60_000, int(rng.integers(5, 100))), EOS))
    infos["web"] = w.close()
    write_manifest(root, Manifest(TokenizerInfo("tok.json", "0" * 64, 65536, EOS, "uint16"), infos,
                                  [Phase("all", {n: 1.0 for n in infos}, 10**9)], validation=val))


@pytest.fixture(scope="module")
def prompts_ds(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("prompts") / "ds")
    make_prompts_dataset(root, {"gsm": 41, "arith": 29})
    return root


def loader(ds: str, G: int = 8, rank: int = 0, world: int = 1, **kw) -> PromptLoader:
    kw.setdefault("seed", 5)
    return PromptLoader(LoaderConfig(dataset=ds, prefetch_threads=2, **kw), G, rank, world)


def ordinals(batch) -> list[int]:
    return [p.ordinal for p in batch]


def test_every_prompt_once_per_epoch_equal_to_iter_prompts(prompts_ds):
    ref = list(iter_prompts(prompts_ds))
    assert [p.ordinal for p in ref] == list(range(70))
    assert [p.doc_id for p in ref[:2]] == ["gsm/q0", "gsm/q1"] and ref[41].doc_id == "arith/q0"
    assert (ref[1].answer, ref[3].answer, ref[5].extra, ref[1].extra) == ("7", None, {"level": 1}, {})
    assert ref[41].source == "arith" and all(3 <= len(p.ids) <= 60 for p in ref)
    ld = loader(prompts_ds)
    assert ld.epoch_prompts == 70 and ld.rows_in_epochs(1.5) == 105 and ld.prompts.ids == [p.doc_id for p in ref]
    assert ld.max_prompt_tokens == max(len(p.ids) for p in ref)
    batches = [next(ld) for _ in range(18)]  # 144 prompts: two epochs and a bit, one batch across each boundary
    assert all(len(b) == 8 for b in batches)
    got = [p for b in batches for p in b]
    assert all(p == ref[p.ordinal] for p in got)
    order = [p.ordinal for p in got]
    assert sorted(order[:70]) == sorted(order[70:140]) == list(range(70))
    assert order[:70] != order[70:140] and order[:70] != list(range(70))
    assert order == ld.ordinals(0, 144).tolist()
    met = ld.metrics()
    assert met["prompts"] == 144 and met["epoch"] == 2 and met["prompt_tokens"] > 0
    ld.close()
    val = list(iter_prompts(prompts_ds, "validation"))
    assert [(p.ordinal, p.doc_id) for p in val[:2]] == [(0, "gsm/q1000"), (1, "gsm/q1001")] and len(val) == 7


def test_order_is_dp_independent_and_deterministic(prompts_ds):
    with loader(prompts_ds) as one:
        ref = [ordinals(next(one)) for _ in range(10)]
    for world in (2, 4):
        parts = [loader(prompts_ds, rank=r, world=world) for r in range(world)]
        for a in ref:
            got = [next(p) for p in parts]
            assert all(len(g) == 8 // world for g in got) and sum(map(ordinals, got), []) == a
        for p in parts:
            p.close()
    with loader(prompts_ds) as again:
        assert [ordinals(next(again)) for _ in range(10)] == ref
    with loader(prompts_ds, seed=6) as other:
        assert ordinals(next(other)) != ref[0]


def test_resume_with_another_dp_size_sees_exactly_the_remaining_prompts(prompts_ds):
    with loader(prompts_ds) as ld:
        ref = [ordinals(next(ld)) for _ in range(12)]
    with loader(prompts_ds) as first:
        for _ in range(5):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert state["consumed"] == 40 and state["kind"] == "prompts"
    parts = [loader(prompts_ds, rank=r, world=2, seq_len=64) for r in range(2)]  # seq_len: not in the order
    for p in parts:
        p.load_state_dict(state)
    for i in range(5, 12):  # across the epoch boundary (prompt 70)
        assert ordinals(next(parts[0])) + ordinals(next(parts[1])) == ref[i]
    with loader(prompts_ds, seed=9) as bad, pytest.raises(ValueError, match="seed"):
        bad.load_state_dict(state)
    with loader(prompts_ds) as bad, pytest.raises(ValueError, match="not a prompt state"):
        bad.load_state_dict({"version": 1, "kind": "pairs", "consumed": 0, "config": {}})
    for p in parts:
        p.close()


def test_errors_sft_loader_skips_prompts_and_doc_meta_checks(prompts_ds, tmp_path):
    with pytest.raises(ValueError, match="bad batch layout"):
        loader(prompts_ds, G=6, world=4)
    text = str(tmp_path / "text")
    make_prompts_dataset(text, {}, text_docs=10)
    with pytest.raises(ValueError, match="no prompts"):
        loader(text)
    with ConversationLoader(LoaderConfig(dataset=prompts_ds, seq_len=128, prefetch_threads=2), 4) as sft:
        assert len(sft.docs.length) == 20  # the text source only
    w = SourceWriter(str(tmp_path / "w"), "p", "uint16", kind="prompts")
    w.add_document("p/a", np.arange(1, 4), meta={"answer": "1"})
    with pytest.raises(ValueError, match="all have metadata or none"):
        w.add_document("p/b", np.arange(1, 4))
    # a doc_meta list that does not match the documents is a ShardError naming the JSON member
    rd = ShardReader(f"{prompts_ds}/gsm/shard-000000.tar")
    e = rd.index[0]
    meta = json.loads(bytes(rd.read_raw(0)[1]))
    assert len(meta["doc_meta"]) == len(meta["doc_ids"])
    bad = json.dumps({**meta, "doc_meta": meta["doc_meta"][1:]}).encode()
    with pytest.raises(ShardError, match=r"json: bad block metadata: doc_meta must be a list of \d+ objects"):
        decode_block(rd.url, e.key, rd.read_raw(0)[0], bad, e.tokens_offset)
