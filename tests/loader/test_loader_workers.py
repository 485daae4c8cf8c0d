"""Worker processes (`workers: N`): same batches as the thread, exact resume, safe zero-copy hand-out,
errors delivered in order, dead workers reported, nothing left running after close."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from storage.config import ConfigError
from storage.loader import LoaderConfig
from storage.shards import ShardError


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_give_the_thread_s_batches_over_epochs(mixed_ds, loader_factory, ld, workers):
    ref = loader_factory(mixed_ds, G=8, rank=1, world=2)
    n = 3 * sum(o.n_seq for o in ref.orders) // 4  # about three epochs of the smallest source
    want = ld.take(ref, n)
    got = ld.take(loader_factory(mixed_ds, G=8, rank=1, world=2, workers=workers, worker_slots=3), n)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"batch {i}"


def test_resume_from_workers_into_a_thread_and_back(mixed_ds, loader_factory, ld):
    want = ld.take(loader_factory(mixed_ds, G=8), 31)
    a = loader_factory(mixed_ds, G=8, workers=2)
    first = ld.take(a, 11)
    b = loader_factory(mixed_ds, G=8)  # the state is a count of sequences: any mode may resume it
    b.load_state_dict(a.state_dict())
    second = ld.take(b, 9)
    c = loader_factory(mixed_ds, G=8, workers=3)
    c.load_state_dict(b.state_dict())
    third = ld.take(c, 10)
    for i, (x, y) in enumerate(zip(want, first + second + third)):
        assert torch.equal(x, y), f"batch {i}"
    a.load_state_dict(c.state_dict())  # a pool restarted in place continues too
    assert torch.equal(next(a), want[30])


def test_held_batches_are_never_overwritten(mixed_ds, loader_factory, ld):
    """Zero-copy batches stay valid while held: with 3 slots, holding 20 batches makes the loader copy
    instead of stalling, and every held batch still equals the thread's."""
    want = ld.take(loader_factory(mixed_ds, G=8), 60)
    loader = loader_factory(mixed_ds, G=8, workers=2, worker_slots=3)
    held = [next(loader) for _ in range(20)]  # no clone: some of these view the shared ring
    ring = loader._pool._slots
    lo, hi = ring.ctypes.data, ring.ctypes.data + ring.nbytes
    in_ring = [lo <= t.data_ptr() < hi for t in held]
    assert in_ring[:2] == [True, True] and not any(in_ring[2:]), in_ring  # slots - 1 zero-copy batches, then copies
    later = ld.take(loader, 20)
    for i, (x, y) in enumerate(zip(want, held + later)):
        assert torch.equal(x, y), f"batch {i}"
    del held  # the slots go back to their workers and are filled again
    for i, (x, y) in enumerate(zip(want[40:], [next(loader) for _ in range(20)])):
        assert torch.equal(x, y), f"batch {40 + i}"


def test_worker_errors_arrive_in_order_as_the_same_exception(corrupt_ds, loader_factory, ld):
    root, shard = corrupt_ds["root"], corrupt_ds["shard"]
    with pytest.raises(ShardError, match="checksum") as ei:
        ld.take(loader_factory(root, workers=2), 12)
    assert shard in str(ei.value) and ei.value.shard == shard
    quarantined = loader_factory(root, workers=2, corruption="quarantine")
    got = ld.take(quarantined, 12)
    ref = ld.take(loader_factory(root, corruption="quarantine"), 12)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert quarantined.metrics()["quarantined_blocks"] >= 1


def test_a_killed_worker_is_reported_not_waited_for(mixed_ds, loader_factory, ld):
    loader = loader_factory(mixed_ds, G=8, workers=2)
    ld.take(loader, 3)
    victim = loader._pool.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"loader worker 1 .*exited with code -9"):
        ld.take(loader, 200)


def test_close_stops_the_workers(mixed_ds, loader_factory, ld):
    loader = loader_factory(mixed_ds, G=8, workers=2)
    ld.take(loader, 2)
    procs = list(loader._pool.procs)
    loader.close()
    assert not any(p.is_alive() for p in procs)
    assert all(p.exitcode == 0 for p in procs)


def test_worker_config_is_checked():
    with pytest.raises(ConfigError, match="workers"):
        LoaderConfig(dataset="x", workers=-1).validate()
    with pytest.raises(ConfigError, match="DALI"):
        LoaderConfig(dataset="x", workers=2, backend="dali").validate()
    with pytest.raises(ConfigError, match="worker_slots"):
        LoaderConfig(dataset="x", workers=2, worker_slots=1).validate()
    assert LoaderConfig(dataset="/local", workers=2).worker_threads() == 0
    assert LoaderConfig(dataset="s3://b/ds", workers=2).worker_threads() == 16
    # decode processes: auto picks one for a local dataset built by the thread, none otherwise
    cpus = len(os.sched_getaffinity(0))
    assert LoaderConfig(dataset="/local").decoders() == (1 if cpus >= 2 else 0)
    assert LoaderConfig(dataset="s3://b/ds").decoders() == 0
    assert LoaderConfig(dataset="/local", workers=2).decoders() == 0
    assert LoaderConfig(dataset="/local", decode_processes=0).decoders() == 0
    assert LoaderConfig(dataset="/local", backend="dali").decoders() == 0
    with pytest.raises(ConfigError, match="decode_processes.*local"):
        LoaderConfig(dataset="s3://b/ds", decode_processes=1).validate()
    with pytest.raises(ConfigError, match="decode_processes"):
        LoaderConfig(dataset="/local", decode_processes=-2).validate()


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_processes_give_the_same_batches(mixed_ds, loader_factory, ld, workers):
    want = ld.take(loader_factory(mixed_ds, G=8), 60)
    loader = loader_factory(mixed_ds, G=8, workers=workers, decode_processes=2)
    for i, (a, b) in enumerate(zip(want, ld.take(loader, 60))):
        assert torch.equal(a, b), f"batch {i}"
    if workers == 0:
        assert loader.store.decoder is not None and loader.metrics()["blocks_read"] > 0


def test_decoder_arena_overflow_decodes_in_the_asking_thread(mixed_ds, loader_factory):
    from storage.dataset import Dataset
    from storage.loader.decoders import DecoderPool

    store = loader_factory(mixed_ds).store
    store.arena()
    store.free_slots = [1, 0]  # an arena with room for two blocks
    pool = DecoderPool(store, 2)
    try:
        jobs = [pool.submit(b) for b in range(5)]  # blocks 0..4 of source 0 (web): 2 in the arena, 3 inline
        assert [j.slot >= 0 for j in jobs] == [True, True, False, False, False]
        web = [sh.read_block(k).tokens for sh in Dataset.open(mixed_ds).readers["web"] for k in range(len(sh))]
        for b, j in enumerate(jobs):
            np.testing.assert_array_equal(j.result()[0], web[b])
            pool.free(j)
        assert sorted(store.free_slots) == [0, 1]
    finally:
        pool.close()
    assert all(code == 0 for code in pool.exitcodes.values())


def test_submitting_to_a_dead_decoder_says_how_it_ended(mixed_ds, loader_factory):
    """A block sent to a decoder that has died (its request pipe broken) is reported with the decoder's exit
    code, not as a bare BrokenPipeError."""
    from storage.loader.decoders import DecoderPool

    pool = DecoderPool(loader_factory(mixed_ds).store, 1)
    try:
        os.kill(pool.pids[0], signal.SIGKILL)
        os.waitid(os.P_PID, pool.pids[0], os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        with pytest.raises(RuntimeError, match=r"decode process 0 .*exited with code -9"):
            pool.submit(0)
    finally:
        pool.close()


def test_decoder_errors_and_deaths_reach_the_consumer(tmp_path, corrupt_ds, loader_factory, ld):
    root, shard = corrupt_ds["root"], corrupt_ds["shard"]
    with pytest.raises(ShardError, match="checksum") as ei:
        ld.take(loader_factory(root, decode_processes=1), 12)
    assert ei.value.shard == shard
    healthy = str(tmp_path / "ok")
    ld.make_dataset(healthy, {"web": 200, "code": 100})
    loader = loader_factory(healthy, decode_processes=1, shuffle_window=4, prefetch_batches=1)
    ld.take(loader, 2)
    os.kill(loader.store.decoder.pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"decode process 0 .*exited with code -9"):
        ld.take(loader, 500)
