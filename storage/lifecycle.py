"""Helper processes that must not outlive the process that started them (Linux parent-death signal).

A process killed with SIGKILL runs no cleanup, so the helper processes libraries start for it (a
multiprocessing Manager server, pool workers) would stay behind blocked on their queues: `die_with_parent`
has the kernel kill the calling process when its parent exits, and `managers_die_with_parent` makes every
Manager started inside it call that first.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Have Linux SIGKILL this process when its parent exits (prctl PR_SET_PDEATHSIG); elsewhere a no-op.
    `parent`: the pid the parent had when it started this process. A parent that died before the call
    took effect (this process was reparented: to another pid than `parent`, or to init) ends it at once."""
    if not sys.platform.startswith("linux"):
        return
    expected = os.getppid() if parent is None else parent
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    now = os.getppid()
    if now != expected or (parent is None and now == 1):  # helpers are never init's own children
        os._exit(1)


@contextlib.contextmanager
def managers_die_with_parent(managers) -> Iterator[None]:
    """While inside, a Manager started through `managers.BaseManager.start` (the stdlib's
    multiprocessing.managers or the multiprocess package's) runs die_with_parent before its own
    initializer (by reference, so spawn-started servers import it from here)."""
    start = managers.BaseManager.start

    def start_dying_with_parent(mgr, initializer=None, initargs=()):
        # the parent's pid is taken here, before the fork: a server that reads its parent only after a
        # SIGKILL of the parent would see init, and live on
        if initializer is None:
            return start(mgr, die_with_parent, (os.getpid(),))
        return start(mgr, _chain, (os.getpid(), initializer, initargs))

    managers.BaseManager.start = start_dying_with_parent
    try:
        yield
    finally:
        managers.BaseManager.start = start


def _chain(parent, initializer, initargs) -> None:
    die_with_parent(parent)
    initializer(*initargs)
