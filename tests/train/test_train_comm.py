"""train.monitor.comm's timing shim in one gloo process: what it counts (by kind, once when nested, async waits),
what it leaves out (paused monitoring reductions, calls outside a step), that a delay injected into the
process group (train.monitor.comm_delay.delayed_collectives, beneath the timer's wrappers) or into an async collective's
completion shows up in what the timer measures, and that uninstall restores every patched function."""
import contextlib
import threading
import time

import pytest
import torch


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield {"tp": ps.get_tensor_model_parallel_group(), "dp": ps.get_data_parallel_group(),
           "pp": ps.get_pipeline_model_parallel_group()}
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def timer(groups):
    from train.monitor.comm import CommTimer

    t = CommTimer(cuda=False, include_one_rank_groups=True)  # one process: every group has one rank
    t.install()
    yield t
    t.uninstall()


@contextlib.contextmanager
def slow_waits(delay_s: float):
    """Every `Work.wait()` (an async collective's completion) sleeps first: the network is slow to finish."""
    import torch.distributed as dist

    raw, orig = dist.Work.__dict__["wait"], dist.Work.wait

    def wait(self, *args, **kwargs):
        time.sleep(delay_s)
        return orig(self, *args, **kwargs)

    dist.Work.wait = wait
    try:
        yield
    finally:
        dist.Work.wait = raw


def _step(timer, delay_s: float, compute_s: float = 0.03) -> tuple[float, float]:
    """A fake training step on a network that is `delay_s` slow per call: compute, three all-reduces, one
    paused metrics reduction → (comm s, step s)."""
    import torch.distributed as dist

    from train.monitor.comm_delay import delayed_collectives

    x = torch.ones(1024)
    t0 = time.perf_counter()
    with timer.measuring(), delayed_collectives(delay_s, one_rank_groups=True):
        time.sleep(compute_s)
        for _ in range(3):
            dist.all_reduce(x)
        with timer.paused():
            dist.all_reduce(torch.zeros(4))
    return sum(timer.collect().values()), time.perf_counter() - t0


def test_share_rises_with_delay_on_the_collective_path(timer):
    d = 0.05
    base_comm, base_step = _step(timer, 0.0)
    comm, step = _step(timer, d)
    base, delayed = base_comm / base_step, comm / step
    assert step >= 0.03 + 4 * d  # the paused reduction was slowed too...
    assert 0.0 <= base < 0.2 and 0.5 < delayed <= 1.0, (base, delayed)
    assert 3 * d <= comm < 3 * d + 0.03  # ...but only the three timed calls count
    # the trainer's debug.comm_delay_s path: measuring(delay) injects the same delay into the process group
    x = torch.ones(8)
    import torch.distributed as dist

    with timer.measuring(d):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        wall = time.perf_counter() - t0
    assert d <= sum(timer.collect().values()) <= wall
    fast = []
    for _ in range(3):  # the process group is fast again after the block (the best of 3: a loaded machine)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        fast.append(time.perf_counter() - t0)
    assert min(fast) < d


def test_every_collective_is_slowed_and_timed(timer):
    """Each collective megatron uses (the distributed optimizer's all-gather and reduce-scatter too) reaches
    a delayed process-group method, and the timer counts it once."""
    import torch.distributed as dist

    from train.monitor.comm_delay import delayed_collectives

    d, x = 0.02, torch.ones(8)
    calls = {"all_reduce": lambda: dist.all_reduce(x), "broadcast": lambda: dist.broadcast(x, 0),
             "barrier": dist.barrier, "all_gather": lambda: dist.all_gather([torch.empty(8)], x),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8), x),
             "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(8), x),
             "all_gather_object": lambda: dist.all_gather_object([None], 1)}
    for name, call in calls.items():
        with timer.measuring(), delayed_collectives(d, one_rank_groups=True):
            t0 = time.perf_counter()
            call()
            wall = time.perf_counter() - t0
        # counted once: at least the delay, at most the call's own wall time (a double count is ~2x it, and a
        # bound on the wall time itself would fail on a loaded machine)
        assert d <= sum(timer.collect().values()) <= wall, name


def test_kinds_nesting_async_and_outside_a_step(timer, groups):
    import torch.distributed as dist

    from train.monitor.comm_delay import delayed_collectives

    d = 0.02
    x = torch.ones(8)
    with timer.measuring(), delayed_collectives(d, one_rank_groups=True):
        dist.all_reduce(x, group=groups["tp"])
        dist.all_reduce(x, group=groups["dp"])
        dist.broadcast(x, 0, group=groups["pp"])
        dist.barrier()                                   # world group: other
        with timer.region("dp"):                         # counted once, as the region's kind
            dist.all_reduce(x, group=groups["tp"])
            dist.all_reduce(x, group=groups["tp"])
        work = dist.all_reduce(x, group=groups["tp"], async_op=True)
        with slow_waits(d):
            work.wait()                                  # issue and a slow completion: tp twice more
        assert work.is_completed()                       # the handle's own methods stay usable
        # another thread (on GPU the backward's TP all-reduces run in autograd's device thread)
        th = threading.Thread(target=dist.all_reduce, args=(x,), kwargs={"group": groups["pp"]})
        th.start()
        th.join()
    s = timer.collect()
    assert d * 3 <= s["dp"] < d * 4 and d * 3 <= s["tp"] < d * 4  # dp: one call + the region's two
    assert d * 2 <= s["pp"] < 3 * d and d <= s["other"] < 2 * d
    assert torch.equal(x, torch.ones(8))
    dist.all_reduce(x)                                   # outside measuring(): not counted
    assert sum(timer.collect().values()) == 0.0
    timer.include_one_rank_groups = False                # the default: groups of one rank move nothing
    with timer.measuring(), delayed_collectives(d, one_rank_groups=True):
        dist.all_reduce(x, group=groups["tp"])
        dist.all_reduce(x)
    assert sum(timer.collect().values()) == 0.0


def test_window_metrics_and_install_restores(groups):
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.tensor_parallel import mappings

    from train.monitor.comm import CommTimer, window_metrics

    originals = (dist.all_reduce, mappings.dist_all_gather_func, pgb._ParamAndGradBucketGroup.finish_grad_sync,
                 P2PCommunicator._communicate)
    t = CommTimer(cuda=False)
    t.install()
    try:
        assert dist.all_reduce is not originals[0] and dist.all_reduce.__comm_original__ is originals[0]
        assert mappings.dist_all_gather_func.__comm_original__ is originals[1]
        assert pgb._ParamAndGradBucketGroup.finish_grad_sync.__comm_original__ is originals[2]
        assert P2PCommunicator._communicate.__comm_original__ is originals[3]
        dist.P2POp(dist.isend, torch.zeros(1), 0)  # P2POp accepts only the original isend/irecv: left alone
        m = window_metrics({"dp": 0.1, "tp": 0.2, "pp": 0.0, "other": 0.1}, 2.0, torch.device("cpu"))
        assert m["comm_share"] == pytest.approx(0.2) and m["comm_share_max"] == pytest.approx(0.2)
        assert m["comm_share_tp"] == pytest.approx(0.1) and m["comm_share_pp"] == 0.0
    finally:
        t.uninstall()
    assert (dist.all_reduce, mappings.dist_all_gather_func, pgb._ParamAndGradBucketGroup.finish_grad_sync,
            P2PCommunicator._communicate) == originals
