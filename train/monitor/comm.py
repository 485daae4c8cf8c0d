"""Communication share of step time: how long a training step is blocked in collectives.

`CommTimer` is installed once per process by the trainer (`install()` / `uninstall()`); it counts only
inside `measuring()` (the trainer wraps the training step in it) and never inside `paused()` (the
trainer's own metric reductions). `collect()` returns seconds per kind since the last call;
`window_metrics()` turns them into the `comm_share*` fields of a log record.

What is timed (the outermost call counts; calls nested in a timed one do not count again):
- `torch.distributed` collectives: all_reduce, all_gather, all_gather_into_tensor, _all_gather_base,
  reduce_scatter, reduce_scatter_tensor, _reduce_scatter_base, broadcast, all_to_all, all_to_all_single,
  barrier, send, recv, batch_isend_irecv, the object collectives (all_gather_object, broadcast_object_list,
  gather_object, scatter_object_list); also megatron's module aliases of them
  (`dist_all_gather_func` / `dist_reduce_scatter_func` in tensor_parallel and the DDP buffers). TP
  exchanges inside the layers and the grad-norm all-reduce are such calls. isend/irecv are left alone
  (`P2POp` accepts only the original functions); their waits are inside the pipeline regions below.
- megatron regions whose individual calls return before data moves (coalesced ops, p2p requests):
  the DDP bucket groups' `start/finish_grad_sync` (DP gradient all-reduce or reduce-scatter; what
  `finalize_model_grads` waits for) and `start/finish_param_sync` (distributed optimizer all-gather)
  → `dp`; `P2PCommunicator._communicate` / `_communicate_shapes` (PP send/recv, waits included) → `pp`.
- an async collective (`async_op=True`) counts its issue and its `wait()`, not the overlap in between.

Kinds: a region's own kind, else the call's process group: the tensor-parallel group → `tp`, data-parallel
groups → `dp`, pipeline and embedding groups → `pp`, anything else (model-parallel grad norm, world) →
`other`. Calls on a group of one rank move no data and are not counted (megatron's vocab-parallel cross
entropy all-reduces over the TP group even at TP=1).

Clock. On CPU (gloo) the calls block: host wall time in the call is time in communication. On CUDA a
collective only enqueues work, so the timer records CUDA events on the current stream before and after
each timed call (a synchronous NCCL call makes the current stream wait for the collective; a `wait()`
does the same for an async one). The figure is therefore *exposed* communication: how long the compute
stream stood still for collectives, including waits for slower ranks (stragglers, the pipeline bubble
in PP receives), but not NCCL time hidden behind compute. Events are resolved in `collect()`, once per log
record, so measuring adds no synchronisation to a step.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import threading
import time
from contextlib import contextmanager

from train.monitor.comm_delay import delayed_collectives

KINDS = ("dp", "tp", "pp", "other")

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
                "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "all_to_all", "all_to_all_single",
                "barrier", "send", "recv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
                "gather_object", "scatter_object_list")
# Modules that bound a collective to a name at import time (megatron-core 0.16).
_ALIAS_MODULES = ("megatron.core.utils", "megatron.core.tensor_parallel.utils",
                  "megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers",
                  "megatron.core.distributed.param_and_grad_buffer")
_ALIASES = ("dist_all_gather_func", "dist_reduce_scatter_func")
# (module, class, methods, kind, attributes holding the group the methods communicate over)
_REGIONS = (
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup",
     ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync"), "dp",
     ("intra_distributed_optimizer_instance_group", "data_parallel_group")),
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator",
     ("_communicate", "_communicate_shapes"), "pp", ("pp_group",)),
)

_CURRENT: CommTimer | None = None   # the installed timer; the wrappers dispatch to it
_PATCHES: list[tuple[object, str, object]] = []  # (owner, name, original) to restore on uninstall


class _TimedWork:
    """An async collective's handle whose `wait()` is timed; everything else is the handle's."""

    __slots__ = ("_work", "_kind")

    def __init__(self, work, kind: str):
        self._work, self._kind = work, kind

    def wait(self, *args, **kwargs):
        t = _CURRENT
        if t is None or not t._counting():
            return self._work.wait(*args, **kwargs)
        token = t._start()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            t._stop(self._kind, token)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommTimer:
    """Seconds spent in communication per kind (`KINDS`), on this rank, while `measuring()`."""

    def __init__(self, cuda: bool | None = None, include_one_rank_groups: bool = False):
        """`cuda`: time with CUDA events (default: when CUDA is in use); `include_one_rank_groups`: also count
        calls on groups of one rank (tests in one process)."""
        if cuda is None:
            import torch

            from train.model import cpu_compat

            cuda = torch.cuda.is_available() and not cpu_compat.active()
        self.cuda = cuda
        self.include_one_rank_groups = include_one_rank_groups
        self._world = 1
        self._measuring = False
        self._local = threading.local()  # .depth: inside a timed call, per thread
        self._paused = 0
        self._seconds = dict.fromkeys(KINDS, 0.0)
        self._pending: list[tuple[str, object, object]] = []   # CUDA: (kind, start event, end event)
        self._free_events: list = []
        self._group_kinds: dict = {}

    # ------------------------------------------------------------------ interface
    def install(self) -> None:
        """Patch torch.distributed, megatron's aliases and regions to report to this timer (idempotent;
        a second timer takes over from the first). Call after megatron's process groups exist."""
        global _CURRENT
        if not _PATCHES:
            _install_patches()
        _CURRENT = self
        self._group_kinds = _group_kinds()
        import torch.distributed as dist

        self._world = dist.get_world_size() if dist.is_initialized() else 1

    def uninstall(self) -> None:
        """Restore every patched function (only if this timer is the installed one)."""
        global _CURRENT
        if _CURRENT is self:
            _CURRENT = None
            for owner, name, orig in reversed(_PATCHES):
                setattr(owner, name, orig)
            _PATCHES.clear()

    @contextmanager
    def measuring(self, delay_s: float = 0.0):
        """Count communication in this block, on every thread (on GPU the backward's TP exchanges run in
        autograd's device threads). `delay_s` > 0 (debug): the block runs under `delayed_collectives`, a
        slow network inside the process groups (train.monitor.comm_delay) that the timer has to observe like any communication."""
        self._measuring = True
        try:
            with delayed_collectives(delay_s, one_rank_groups=self.include_one_rank_groups):
                yield self
        finally:
            self._measuring = False

    @contextmanager
    def paused(self):
        """Do not count this block (the monitoring's own reductions)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextmanager
    def region(self, kind: str):
        """Time a block as communication of `kind` (calls inside it are not counted again)."""
        if not self._counting():
            yield
            return
        token = self._start()
        try:
            yield
        finally:
            self._stop(kind, token)

    def collect(self) -> dict[str, float]:
        """Seconds per kind since the last call (CUDA events resolved here, waiting for the last ones)."""
        for kind, start, end in self._pending:
            end.synchronize()
            self._seconds[kind] += start.elapsed_time(end) / 1000.0
            self._free_events += [start, end]
        self._pending.clear()
        out, self._seconds = self._seconds, dict.fromkeys(KINDS, 0.0)
        return out

    # ------------------------------------------------------------------ internals
    def _counting(self) -> bool:
        """Whether a call now is to be timed: measuring, not paused, not inside a timed call."""
        return self._measuring and not self._paused and not getattr(self._local, "depth", 0)

    def _start(self):
        """Start timing (after `_counting()`): a token for `_stop`."""
        self._local.depth = 1
        if self.cuda:
            import torch

            ev = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
            ev.record()
            token = ev
        else:
            token = time.perf_counter()
        return token

    def _stop(self, kind: str, token) -> None:
        self._local.depth = 0
        if self.cuda:
            import torch

            end = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((kind, token, end))
        else:
            self._seconds[kind] += time.perf_counter() - token

    def _kind_of(self, group) -> str | None:
        """The kind of a call on `group` (None stands for the world), or None when it has one rank."""
        if group is None:
            return "other" if self._world > 1 or self.include_one_rank_groups else None
        kind = self._group_kinds.get(group)
        if kind is None:
            try:
                kind = "other" if group.size() > 1 else ""
            except Exception:  # noqa: BLE001 - not a ProcessGroup we can ask: count it
                kind = "other"
            self._group_kinds[group] = kind
        if kind.startswith("1:"):  # a known group of one rank
            return kind[2:] if self.include_one_rank_groups else None
        return kind or ("other" if self.include_one_rank_groups else None)


def window_metrics(seconds: dict[str, float], elapsed_s: float, device) -> dict[str, float]:
    """Log-record fields from this rank's `collect()` over a window of `elapsed_s` seconds of steps:
    `comm_share` (mean over ranks of communication time / step time), `comm_share_max` (the highest
    rank's), `comm_share_<kind>` (mean over ranks; they sum to `comm_share`). A collective itself: every
    rank must call it (outside `measuring()`, so it is not counted)."""
    import torch
    import torch.distributed as dist

    shares = [seconds.get(k, 0.0) / elapsed_s if elapsed_s > 0 else 0.0 for k in KINDS]
    t = torch.tensor([*shares, sum(shares)], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        t = torch.stack(parts)
    else:
        t = t.unsqueeze(0)
    mean = t.mean(dim=0).tolist()
    out = {"comm_share": mean[-1], "comm_share_max": float(t[:, -1].max())}
    out.update({f"comm_share_{k}": mean[i] for i, k in enumerate(KINDS)})
    return out


# ---------------------------------------------------------------------- patching
def _arg_index(fn, name: str) -> int | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) if name in params else None


def _arg(args, kwargs, name: str, index: int | None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if index is not None and index < len(args) else None


def _wrap_collective(orig):
    gpos, apos = _arg_index(orig, "group"), _arg_index(orig, "async_op")
    batched = orig.__name__ == "batch_isend_irecv"

    @functools.wraps(orig)
    def timed(*args, **kwargs):
        t = _CURRENT
        if t is None or not t._counting():
            return orig(*args, **kwargs)
        if batched:
            ops = _arg(args, kwargs, "p2p_op_list", 0) or []
            kind = t._kind_of(getattr(ops[0], "group", None)) if ops else None
        else:
            kind = t._kind_of(_arg(args, kwargs, "group", gpos))
        if kind is None:  # a group of one rank: nothing moves
            return orig(*args, **kwargs)
        token = t._start()
        try:
            work = orig(*args, **kwargs)
        finally:
            t._stop(kind, token)
        if batched:
            return [_TimedWork(w, kind) for w in work]
        if work is not None and _arg(args, kwargs, "async_op", apos):
            return _TimedWork(work, kind)
        return work

    timed.__comm_original__ = orig
    return timed


def _wrap_region(orig, kind: str, group_attrs: tuple[str, ...]):
    @functools.wraps(orig)
    def timed(self, *args, **kwargs):
        t = _CURRENT
        if t is None or not t._counting():
            return orig(self, *args, **kwargs)
        group = next((g for g in (getattr(self, a, None) for a in group_attrs) if g is not None), None)
        if group is not None and t._kind_of(group) is None:  # one rank (DP=1): nothing moves
            return orig(self, *args, **kwargs)
        token = t._start()
        try:
            return orig(self, *args, **kwargs)
        finally:
            t._stop(kind, token)

    timed.__comm_original__ = orig
    return timed


def _patch(owner, name: str, new) -> None:
    _PATCHES.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)


def _install_patches() -> None:
    import torch.distributed as dist

    wrapped = {}
    for name in _COLLECTIVES:
        orig = getattr(dist, name, None)
        if orig is None or hasattr(orig, "__comm_original__"):
            continue
        wrapped[orig] = _wrap_collective(orig)
        _patch(dist, name, wrapped[orig])
    for modname in _ALIAS_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for alias in _ALIASES:
            fn = getattr(mod, alias, None)
            if fn is not None and not hasattr(fn, "__comm_original__"):
                _patch(mod, alias, wrapped.get(fn) or _wrap_collective(fn))
    for modname, clsname, methods, kind, group_attrs in _REGIONS:
        try:
            cls = getattr(importlib.import_module(modname), clsname)
        except (ImportError, AttributeError):
            continue
        for m in methods:
            fn = getattr(cls, m, None)
            if fn is not None and not hasattr(fn, "__comm_original__"):
                _patch(cls, m, _wrap_region(fn, kind, group_attrs))


def _group_kinds() -> dict:
    """ProcessGroup → kind ("1:<kind>" for a group of one rank), from megatron's parallel_state (empty
    when it is not initialised)."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return {}
    if not ps.model_parallel_is_initialized():
        return {}
    getters = [("tp", ps.get_tensor_model_parallel_group, {}),
               ("pp", ps.get_pipeline_model_parallel_group, {}),
               ("pp", ps.get_embedding_group, {}),
               ("pp", ps.get_position_embedding_group, {}),
               ("dp", ps.get_data_parallel_group, {}),
               ("dp", ps.get_data_parallel_group, {"with_context_parallel": True}),
               ("dp", ps.get_intra_distributed_optimizer_instance_group, {})]
    out: dict = {}
    for kind, getter, kw in getters:
        try:
            groups = getter(check_initialized=False, **kw) if "check_initialized" in \
                inspect.signature(getter).parameters else getter(**kw)
        except Exception:  # noqa: BLE001 - a group this rank is not part of, or not created
            continue
        for g in groups if isinstance(groups, (list, tuple)) else [groups]:
            if g is not None:
                out.setdefault(g, kind if g.size() > 1 else f"1:{kind}")
    return out
