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


def die_with_parent() -> None:
    """Have Linux SIGKILL this process when its parent exits (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the call took effect
        os._exit(1)


@contextlib.contextmanager
def managers_die_with_parent(managers) -> Iterator[None]:
    """While inside, a Manager started through `managers.BaseManager.start` (the stdlib's
    multiprocessing.managers or the multiprocess package's) runs die_with_parent before its own
    initializer (by reference, so spawn-started servers import it from here)."""
    start = managers.BaseManager.start

    def start_dying_with_parent(mgr, initializer=None, initargs=()):
        if initializer is None:
            return start(mgr, die_with_parent, ())
        return start(mgr, _chain, (initializer, initargs))

    managers.BaseManager.start = start_dying_with_parent
    try:
        yield
    finally:
        managers.BaseManager.start = start


def _chain(initializer, initargs) -> None:
    die_with_parent()
    initializer(*initargs)
