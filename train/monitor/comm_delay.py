"""Debug: a slow network. `delayed_collectives` makes every communication call of this process wait inside
the process group, beneath every wrapper above it, so that the communication timer (train.monitor.comm) can
be tested against a delay it did not inject itself, and `debug.comm_delay_s` can show what a slow link costs."""
from __future__ import annotations

import time
from contextlib import contextmanager

# The torch.distributed.ProcessGroup methods that start communication: every collective, barrier and
# send/recv of torch.distributed (and so of megatron) ends in one of them.
# (torch 2.13 names; older ones kept, missing ones skipped).
_PG_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
               "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_single",
               "reduce_scatter_single_coalesced", "broadcast", "barrier", "monitored_barrier", "alltoall",
               "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource", "reduce", "gather", "scatter")


@contextmanager
def delayed_collectives(delay_s: float, one_rank_groups: bool = False):
    """Debug: a slow network. In this block every communication call of this process sleeps `delay_s`
    inside the process group (the `ProcessGroup` methods above, patched on the class), before the work
    starts: beneath torch.distributed's functions, megatron's aliases and regions, and the timer's
    wrappers, so a timer sees the delay only by timing the real call. Groups of one rank move nothing
    and are not delayed unless `one_rank_groups` (tests in one process)."""
    if delay_s <= 0:
        yield
        return
    import torch.distributed as dist

    pg = dist.ProcessGroup
    saved = []
    for name in _PG_METHODS:
        raw = pg.__dict__.get(name)  # the descriptor itself: putting back getattr's bound form breaks calls
        if raw is None:
            continue
        orig = getattr(pg, name)

        def slow(self, *args, _orig=orig, **kwargs):
            if one_rank_groups or self.size() > 1:
                time.sleep(delay_s)
            return _orig(self, *args, **kwargs)

        saved.append((name, raw))
        setattr(pg, name, slow)
    try:
        yield
    finally:
        for name, raw in saved:
            setattr(pg, name, raw)
