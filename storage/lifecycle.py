"""How our processes end: helpers that must not outlive their parent, and commands that exit without the
interpreter's teardown.

A process killed with SIGKILL runs no cleanup, so the helper processes libraries start for it (a
multiprocessing Manager server, pool workers) would stay behind blocked on their queues: `die_with_parent`
has the kernel kill the calling process when its parent exits, and `managers_die_with_parent` makes every
Manager started inside it call that first.

`run_main` is the end of every command's process (the `train`, `datapipe`, `storage` scripts, each
training rank and the other workers they start: evaluation, reference log-probs, checkpoint import):
everything Python's exit does that a finished command needs, without the teardown that frees every module
and object (0.8 s for a CLI process with torch and megatron imported, 1.7 s for a training rank, on this
project's 2-core machine).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

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


def run_main(main: Callable[[], object]) -> NoReturn:
    """Run `main` (a click group in standalone mode, or a function returning an exit code) and end the process
    as Python's exit would, minus the interpreter's teardown: the exit code from its return value or
    SystemExit, an uncaught exception printed by `sys.excepthook` (code 1), non-daemon threads joined and
    their exit hooks run (`threading._shutdown`, Python's first step at exit), `atexit` handlers run (logging's
    flush, multiprocessing's child cleanup, `weakref.finalize` objects such as temporary folders), Python's
    and C's stdio buffers flushed, then `os._exit`. What it skips is objects' `__del__` at teardown: files a
    command writes are closed by the command itself. KeyboardInterrupt propagates as usual."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    except Exception:
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
    os._exit(code)
