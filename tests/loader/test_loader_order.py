"""Global order: packing covers each epoch exactly once, and the stream ignores DP size and threads."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.dataset import Dataset
from storage.loader.pack import finish


def test_one_epoch_is_the_permuted_block_stream_cut_once(tmp_path, ld, loader_factory):
    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 120})
    seq_len = 32
    loader = loader_factory(root, G=4, seq_len=seq_len, shuffle_window=16)
    order = loader.orders[0]
    n = order.n_seq
    batches = ld.take(loader, -(-n // 4))
    rows = torch.cat(batches)[:n].numpy()
    positions = [order.position(k) for k in range(n)]
    assert sorted(q for _, q in positions) == list(range(n)), "an epoch must use every sequence once"
    assert [q for _, q in positions] != list(range(n)), "window shuffle did nothing"
    # rebuild the epoch's stream from the shards, independently of the loader's packing code
    ds = Dataset.open(root)
    blocks = [sh.read_block(k).tokens for sh in ds.readers["web"] for k in range(len(sh))]
    perm = order._epoch(0)[0]
    assert sorted(perm.tolist()) == list(range(len(blocks)))
    stream = np.concatenate([blocks[b] for b in perm]).astype(np.int64)
    by_pos = np.empty((n, seq_len + 1), dtype=np.int64)
    for row, (_, q) in zip(rows, positions):
        by_pos[q] = row
    for q in range(n):
        np.testing.assert_array_equal(by_pos[q], stream[q * seq_len: q * seq_len + seq_len + 1])
    # the next epoch uses another block permutation
    assert not np.array_equal(order._epoch(1)[0], perm)


@pytest.mark.parametrize("threads", [1, 3])
def test_recycled_block_buffers_match_the_shards_over_epochs(tmp_path, ld, loader_factory, threads):
    """Blocks not needed within a shuffle window give their buffers to later blocks; over 2.5 epochs every
    row still equals its tokens read straight from the shards, and the cache stays near the blocks of the
    planned batches (here 4 batches of 4 = one window of 16 sequences), also over the epoch boundaries,
    though the budget would hold the whole source."""
    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 240}, block_tokens=512)
    loader = loader_factory(root, G=4, seq_len=32, shuffle_window=16, prefetch_threads=threads, prefetch_batches=4)
    order = loader.orders[0]
    rows = torch.cat(ld.take(loader, -(-5 * order.n_seq // 8))).numpy()
    ds = Dataset.open(root)
    blocks = [sh.read_block(k).tokens for sh in ds.readers["web"] for k in range(len(sh))]
    for k, row in enumerate(rows):
        want = np.concatenate([blocks[b][a:z] for b, a, z in order.pieces(k)])
        np.testing.assert_array_equal(row, want, err_msg=f"sequence {k}")
    m = loader.metrics()
    everything = sum(loader.store.cost(b) for b in range(len(blocks)))  # source 0: block id == block number
    assert everything < loader.cfg.max_bytes_in_flight
    assert m["blocks_read"] >= 2 * len(blocks), "later epochs should read blocks again, not keep them all"
    assert m["peak_bytes_in_flight"] < everything / 3, (m["peak_bytes_in_flight"], everything)


@pytest.mark.parametrize("mode", ["threads", "decoder", "workers", "private buffers"])
def test_rows_equal_the_shards_tokens_in_every_build_path(mixed_ds, loader_factory, mode):
    """Every row of three sources (rows whole in one block are gathered from the arena, rows across two
    blocks copied piece by piece, a worker's share of rows placed into its batch, and blocks that found no
    free arena slot sliced and concatenated) equals its tokens read straight from the shards."""
    kw = {"threads": {"decode_processes": 0}, "decoder": {"decode_processes": 1},
          "workers": {"workers": 2}, "private buffers": {"decode_processes": 0}}[mode]
    G, steps = 8, 40
    loader = loader_factory(mixed_ds, G=G, seq_len=48, **kw)
    if mode == "private buffers":
        loader.store.arena()
        loader.store.free_slots = [0]  # one slot: the other blocks decode into buffers of their own
    ds = Dataset.open(mixed_ds)
    blocks = [[sh.read_block(k).tokens for sh in ds.readers[name] for k in range(len(sh))]
              for name in loader.sources]
    rows = torch.cat([next(loader).clone() for _ in range(steps)]).numpy()
    srcs, curs = loader.assignments(0, G * steps)
    spanning = 0
    for g, (s, k) in enumerate(zip(srcs.tolist(), curs.tolist())):
        pieces = loader.orders[s].pieces(k)
        spanning += len(pieces) > 1
        want = np.concatenate([blocks[s][b][a:z] for b, a, z in pieces])
        np.testing.assert_array_equal(rows[g], want, err_msg=f"global sequence {g} ({mode})")
    assert spanning > 10 and len(set(srcs.tolist())) == 3
    if mode == "private buffers":
        assert loader.store._entries and all(e.slot < 0 for bid, e in loader.store._entries.items()
                                             if e.tokens is not None and e.slot != 0)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_cache_does_not_grow_over_epoch_boundaries(tmp_path, ld, loader_factory, seed):
    """Blocks kept for a use in the next epoch must not pile up at each boundary (they would hold buffers
    touched for the first time mid-run): the cache's peak over 2.75 epochs stays within 1.5x its peak in
    the first 3/4 of epoch 0 (keeping every block needed again later in the next epoch: 1.9x to 2.3x)."""
    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 240}, block_tokens=512)
    loader = loader_factory(root, G=4, seed=seed, shuffle_window=64, prefetch_threads=1, prefetch_batches=16)
    n = loader.orders[0].n_seq
    ld.take(loader, 3 * n // 16)
    early = loader.store.peak_bytes_in_flight
    ld.take(loader, 11 * n // 16 - 3 * n // 16)
    assert loader.store.peak_bytes_in_flight <= 1.5 * early, (loader.store.peak_bytes_in_flight, early)


def test_done_with_keeps_a_block_only_for_a_use_within_the_horizon(tmp_path, ld, loader_factory):
    """A block is kept while it is in use this epoch; after its last use it is kept only if its first
    window of the next epoch starts within `horizon` cursors; a block whose first window this epoch is
    further ahead than that is not kept either."""
    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 240}, block_tokens=512)
    order = loader_factory(root, G=4, seq_len=32, shuffle_window=16).orders[0]
    n, w = order.n_seq, order.window
    which, blk, *_ = order.locate(np.arange(2 * n))
    checked = 0
    for b in range(len(order.block_tokens)):
        uses = which[blk == b]
        if not len(uses[uses < n]) or not len(uses[uses >= n]):
            continue  # only in the dropped tail of an epoch
        checked += 1
        first0 = int(uses[uses < n].min()) // w * w
        last0 = int(uses[uses < n].max())
        first1 = n + (int(uses[uses >= n].min()) - n) // w * w  # windows start at the epoch start
        assert not order.done_with(b, first0, horizon=0)  # in use
        if first0 > 0:
            assert order.done_with(b, first0 - 1, horizon=0) and not order.done_with(b, first0 - 1, horizon=1)
        after = last0 // w * w + w  # the first cursor past the window of its last use this epoch
        if after < n:
            assert order.done_with(b, after, horizon=first1 - after - 1)
            assert not order.done_with(b, after, horizon=first1 - after)
    assert checked > len(order.block_tokens) // 2


def ld_take(loader, steps):
    return [next(loader).clone() for _ in range(steps)]


@pytest.mark.parametrize("threads", [1, 3])
def test_dp_ranks_union_equals_single_rank_stream(mixed_ds, loader_factory, threads):
    G, steps = 8, 12
    ref = ld_take(loader_factory(mixed_ds, G=G, prefetch_threads=threads), steps)
    assert all(b.shape == (G, 33) and b.dtype == torch.int64 for b in ref)
    for world in (2, 4):
        per_rank = [ld_take(loader_factory(mixed_ds, G=G, rank=r, world=world, prefetch_threads=4 - threads), steps)
                    for r in range(world)]
        for i in range(steps):
            assert all(per_rank[r][i].shape == (G // world, 33) for r in range(world))
            torch.testing.assert_close(torch.cat([per_rank[r][i] for r in range(world)]), ref[i], rtol=0, atol=0)


def test_byte_budget_bounds_memory_and_changes_nothing(mixed_ds, loader_factory):
    roomy = loader_factory(mixed_ds, G=8, prefetch_batches=8)
    ref = ld_take(roomy, 6)
    tight = loader_factory(mixed_ds, G=8, max_bytes_in_flight=1, prefetch_batches=2, prefetch_threads=1)
    for a, b in zip(ref, ld_take(tight, 6)):
        assert torch.equal(a, b)
    # over budget the planner holds the blocks of one chunk (prefetch_batches batches) only
    one_chunk = max(sum(tight.store.cost(b) for b in finish(tight._plan(j, 2))[0].chunk.blocks) for j in range(0, 10, 2))
    assert tight.metrics()["peak_bytes_in_flight"] <= one_chunk < roomy.metrics()["peak_bytes_in_flight"]


def test_seed_changes_order_and_same_seed_repeats(mixed_ds, loader_factory):
    a = ld_take(loader_factory(mixed_ds, seed=1), 3)
    b = ld_take(loader_factory(mixed_ds, seed=1), 3)
    c = ld_take(loader_factory(mixed_ds, seed=2), 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_long_document_does_not_fill_a_batch(tmp_path, ld, loader_factory):
    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 60}, long_doc=32 * 40)  # one document of 40 sequences
    long_id = 1

    def worst_batch(window):
        loader = loader_factory(root, G=8, shuffle_window=window)
        n_batches = -(-loader.orders[0].n_seq // 8)
        worst = 0
        for b in ld_take(loader, n_batches):
            worst = max(worst, int((b == long_id).all(dim=1).sum()))
        return worst

    # without a shuffle window the long document fills whole batches: the check below can fail
    assert worst_batch(1) == 8
    assert worst_batch(256) <= 4


def test_dataloader_workers_keep_the_order(mixed_ds, loader_factory):
    from storage.loader import LoaderConfig, TokenIterableDataset

    ref = ld_take(loader_factory(mixed_ds, G=8, rank=1, world=2), 6)
    cfg = LoaderConfig(dataset=mixed_ds, seq_len=32, seed=7, shuffle_window=16, prefetch_threads=2)
    ds = TokenIterableDataset(cfg, 8, dp_rank=1, dp_size=2)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    got = []
    for b in dl:
        got.append(b)
        if len(got) == 6:
            break
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert ds.state_dict(6)["consumed"] == 6 * 8
