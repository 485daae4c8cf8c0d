"""PairLoader: every pair once per epoch, chosen/rejected rows adjacent and equal to iter_pairs, a global
order independent of the DP size, exact resume with another DP size; SourceWriter.add_group."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.dataset import SourceWriter
from storage.loader import LoaderConfig
from storage.loader.conversations import ConversationLoader
from storage.loader.pairs import PairLoader, iter_pairs
from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest
from storage.shards import ShardReader

S = 160
EOS = 0


def make_pref_dataset(root: str, pairs: dict[str, int], text_docs: int = 30, seed: int = 0,
                      block_tokens: int = 256) -> Manifest:
    """Preference sources (name → pairs; sides of 5..150 tokens, the first 1..4 tokens a prompt outside the
    mask) and one text source, as datapipe writes them."""
    rng = np.random.default_rng(seed)
    infos = {}
    for name, n in pairs.items():
        w = SourceWriter(root, name, "uint16", block_tokens=block_tokens, shard_blocks=3, kind="preference")
        for i in range(n):
            group = []
            for side in ("chosen", "rejected"):
                L = int(rng.integers(5, 151))
                mask = (np.arange(L) >= int(rng.integers(1, 5))).astype(np.uint8)
                group.append((f"{name}/{i}#{side}", rng.integers(1, 60_000, L), mask))
            w.add_group(group)
        infos[name] = w.close()
    w = SourceWriter(root, "web", "uint16", block_tokens=block_tokens)
    for i in range(text_docs):
        w.add_document(f"web/{i}", np.append(rng.integers(1, 60_000, int(rng.integers(5, 100))), EOS))
    infos["web"] = w.close()
    m = Manifest(TokenizerInfo("tok.json", "0" * 64, 65536, EOS, "uint16"), infos,
                 [Phase("all", {n: 1.0 for n in infos}, 10**9)], format_version=2)
    write_manifest(root, m)
    return m


@pytest.fixture(scope="module")
def pref_ds(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("pairs") / "ds")
    make_pref_dataset(root, {"hh": 37, "uf": 23})
    return root


def loader(ds: str, G: int = 8, rank: int = 0, world: int = 1, **kw) -> PairLoader:
    kw.setdefault("seq_len", S)
    kw.setdefault("seed", 5)
    return PairLoader(LoaderConfig(dataset=ds, prefetch_threads=2, **kw), G, rank, world)


def check_row(row: torch.Tensor, tokens: np.ndarray, mask: np.ndarray, ordinal: int, pad: int = EOS) -> None:
    tok, lab, m, seg, o = (row[i].numpy() for i in range(5))
    L = len(tokens)
    assert (tok[:L] == tokens).all() and (tok[L:] == pad).all()
    assert (lab[:L - 1] == tokens[1:]).all() and (lab[L - 1:] == 0).all()
    assert (m[:L - 1] == mask[1:]).all() and (m[L - 1:] == 0).all()
    assert (seg[:L] == 0).all() and (seg[L:] == -1).all()
    assert (o == ordinal).all()


def test_source_writer_add_group_keeps_a_group_in_one_block(tmp_path):
    w = SourceWriter(str(tmp_path), "p", "uint16", block_tokens=100, shard_blocks=50, kind="preference")
    sizes = [(30, 30), (20, 15), (60, 50), (10, 10), (40, 45), (5, 5)]
    for i, (a, b) in enumerate(sizes):
        w.add_group([(f"{i}#chosen", np.full(a, i + 1), np.ones(a, np.uint8)),
                     (f"{i}#rejected", np.full(b, i + 1), np.zeros(b, np.uint8))])
    info = w.close()
    assert info.kind == "preference" and info.documents == 12
    rd = ShardReader(str(tmp_path / info.shards[0].path))
    blocks = [list(rd.read_block(k).doc_ids) for k in range(len(rd.index))]
    # 60 + 35 fit one block; 110 (longer than a block) gets its own; 20 + 85 do not fit; 85 + 10 do
    assert blocks == [["0#chosen", "0#rejected", "1#chosen", "1#rejected"], ["2#chosen", "2#rejected"],
                      ["3#chosen", "3#rejected"], ["4#chosen", "4#rejected", "5#chosen", "5#rejected"]]


def test_every_pair_once_per_epoch_adjacent_and_equal_to_iter_pairs(pref_ds):
    ref = list(iter_pairs(pref_ds))
    assert [p[0] for p in ref] == list(range(60))
    assert [p[1] for p in ref[:2]] == ["hh/0", "hh/1"] and ref[37][1] == "uf/0"
    uf = list(iter_pairs(pref_ds, source="uf"))  # one source: its pairs, ordinals as in the whole split
    assert [(p[0], p[1]) for p in uf] == [(p[0], p[1]) for p in ref[37:]] and (uf[5][2] == ref[42][2]).all()
    with pytest.raises(ValueError, match="no source 'web2'"):
        list(iter_pairs(pref_ds, source="web2"))
    ld = loader(pref_ds)
    assert ld.epoch_pairs == 60 and ld.rows_in_epochs(1.5) == 90 and ld.pairs.ids == [p[1] for p in ref]
    batches = [next(ld) for _ in range(15)]  # 120 pairs: two epochs, one batch across the boundary
    assert all(b.shape == (16, 5, S) and b.dtype == torch.int64 for b in batches)
    order = []
    for b in batches:
        for k in range(0, 16, 2):
            o = int(b[k, 4, 0])
            _, _, ct, cm, rt, rm = ref[o]
            check_row(b[k], ct, cm, o)
            check_row(b[k + 1], rt, rm, o)
            order.append(o)
    assert sorted(order[:60]) == sorted(order[60:]) == list(range(60))
    assert order[:60] != order[60:] and order[:60] != list(range(60))
    assert order == ld.ordinals(0, 120).tolist()
    met = ld.metrics()
    assert met["pairs"] == 120 and met["epoch"] == 2 and met["nonpad_tokens"] > 0
    ld.close()


def test_order_is_dp_independent_and_deterministic(pref_ds):
    with loader(pref_ds) as one:
        ref = [next(one) for _ in range(9)]
    halves = [loader(pref_ds, rank=r, world=2) for r in range(2)]
    for a in ref:
        got = [next(h) for h in halves]
        assert all(g.shape == (8, 5, S) for g in got) and torch.equal(a, torch.cat(got))
    quarters = [loader(pref_ds, rank=r, world=4) for r in range(4)]
    for a in ref:
        assert torch.equal(a, torch.cat([next(q) for q in quarters]))
    with loader(pref_ds) as again:
        assert all(torch.equal(next(again), a) for a in ref)
    with loader(pref_ds, seed=6) as other:
        assert not torch.equal(next(other), ref[0])
    for x in (*halves, *quarters):
        x.close()


def test_resume_with_another_dp_size_sees_exactly_the_remaining_pairs(pref_ds):
    with loader(pref_ds) as ld:
        ref = [next(ld) for _ in range(12)]
    with loader(pref_ds) as first:
        for _ in range(5):
            next(first)
        state = first.state_dict()
    assert state["consumed"] == 40 and state["kind"] == "pairs"
    parts = [loader(pref_ds, rank=r, world=2) for r in range(2)]
    for p in parts:
        p.load_state_dict(state)
    for i in range(5, 12):  # across the epoch boundary (pair 60)
        assert torch.equal(torch.cat([next(p) for p in parts]), ref[i])
    with loader(pref_ds, seq_len=S + 16) as longer:  # the order does not depend on seq_len
        longer.load_state_dict(state)
        assert torch.equal(next(longer)[:, :, :S], ref[5])
    with loader(pref_ds, seed=9) as bad, pytest.raises(ValueError, match="seed"):
        bad.load_state_dict(state)
    with loader(pref_ds) as bad, pytest.raises(ValueError, match="not a preference-pair state"):
        bad.load_state_dict({"version": 1, "kind": "packed", "consumed": 0, "config": {}})
    for p in parts:
        p.close()


def test_errors_and_the_sft_loader_skips_pairs(pref_ds, tmp_path):
    longest = max(max(len(p[2]), len(p[4])) for p in iter_pairs(pref_ds))
    with pytest.raises(ValueError, match=r"preference pair '(hh|uf)/\d+': chosen has \d+ tokens, rejected \d+; "
                                         rf"seq_len is {longest - 1}"):
        loader(pref_ds, seq_len=longest - 1)
    loader(pref_ds, seq_len=longest).close()  # a side of exactly seq_len tokens fits
    with pytest.raises(ValueError, match="bad batch layout"):
        loader(pref_ds, G=6, world=4)
    text = str(tmp_path / "text")
    make_pref_dataset(text, {}, text_docs=10)
    with pytest.raises(ValueError, match="no preference pairs"):
        loader(text)
    with ConversationLoader(LoaderConfig(dataset=pref_ds, seq_len=S, prefetch_threads=2), 4) as sft:
        assert len(sft.docs.length) == 30  # the text source only
