"""Run untrusted programs (generated code: code benchmarks, code rewards) in a sandbox, never in the caller's
process or a bare subprocess.

Each program runs under bubblewrap (`bwrap`, Debian's `bubblewrap` package) in its own namespaces:
- no network (a new network namespace: not even the host's loopback), no IPC, no view of other processes
  (a new PID namespace: when the program's first process ends, the kernel kills everything it started,
  double-forked daemons and signal-ignoring children included; `--die-with-parent` ends it with us);
- a filesystem of the interpreter's own files (its prefix, `/usr`, `/lib*`, read-only), an empty `/tmp`,
  `/proc` and `/dev` of the sandbox, and a fresh empty working directory, the only place it can write;
  nothing else of the host (home, the project, /etc) is visible;
- a clean environment (`PATH`, `HOME` = the working directory, `LANG`), every capability dropped, a new
  session (no terminal to inject keystrokes into);
- limits: CPU seconds, address space, file size and open files (`setrlimit`), the number of processes
  (`RLIMIT_NPROC`, counted per user: when we run as root, each parallel slot runs as its own unprivileged
  uid, so one program's fork bomb cannot starve another's), wall time (the process group killed), and
  the output kept (stdout and stderr go to files in the working directory, bounded by the file-size limit).
The interpreter must be readable by the sandbox's uid: by default the system's `python3` (under `/usr`), else
ours. `docs/security.md` says what this stops and what it does not.

`Sandbox.run(program)` → `Execution` (`passed`, `failed` (an assertion), `error` (another exception or a
non-zero exit), `timeout`, `killed` (a signal: the CPU, memory or process limit), with the reason and the
ends of stdout and stderr); `Sandbox.map(programs)` runs them in parallel, one per core. Without `bwrap`
it refuses (`SandboxUnavailable`, saying what to install) unless built with `unsafe=True` (the CLI's
`--unsafe-exec`), which runs the program in a bare subprocess with the same limits but no isolation.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

STATUSES = ("passed", "failed", "error", "timeout", "killed")
_BASE_UID = 64_000  # slot k runs as uid/gid BASE + k when we are root (no passwd entry needed)


class SandboxUnavailable(RuntimeError):
    """No sandbox tool on this machine, and unsafe execution was not asked for."""


@dataclass
class Limits:
    cpu_s: int = 10
    wall_s: float = 20.0
    memory_mb: int = 2048  # address space
    file_mb: int = 16  # largest file it may write (its stdout and stderr included)
    processes: int = 64
    open_files: int = 256
    output_chars: int = 4096  # of stdout and stderr kept in the result


@dataclass
class Execution:
    status: str
    reason: str = ""
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def sandbox_tools(unsafe: bool = False) -> tuple[str | None, str, str | None]:
    """(bwrap, prlimit, setpriv) paths; SandboxUnavailable, saying what to install, when one is missing (bwrap
    may be missing only when `unsafe`; setpriv is needed only by root, to run programs as another user)."""
    bwrap, prlimit, setpriv = shutil.which("bwrap"), shutil.which("prlimit"), shutil.which("setpriv")
    if prlimit is None:
        raise SandboxUnavailable("prlimit (util-linux) is not installed: the sandbox's limits need it")
    if setpriv is None and os.geteuid() == 0:
        raise SandboxUnavailable("setpriv (util-linux) is not installed: running as root, the sandbox needs it "
                                 "to run each program as an unprivileged user")
    if bwrap is None and not unsafe:
        raise SandboxUnavailable(
            "no sandbox for generated code: bubblewrap (bwrap) is not installed; install it (Debian/Ubuntu: "
            "apt-get install bubblewrap) or pass --unsafe-exec to run generated programs without isolation")
    return bwrap, prlimit, setpriv


def _interpreter() -> str:
    system = "/usr/bin/python3"
    return system if os.access(system, os.X_OK) else os.path.realpath(sys.executable)


@dataclass
class Sandbox:
    limits: Limits = field(default_factory=Limits)
    python: str = field(default_factory=_interpreter)
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    unsafe: bool = False  # run without isolation when bwrap is missing (never the default)

    def __post_init__(self):
        self.bwrap, self.prlimit, self.setpriv = sandbox_tools(self.unsafe)
        self.python = os.path.realpath(self.python)
        self._slots = list(range(self.workers))
        self._lock = threading.Lock()

    def map(self, programs: list[str]) -> list[Execution]:
        """Run every program (in parallel, `workers` at a time); results in order."""
        if not programs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.workers, len(programs))) as pool:
            return list(pool.map(self.run, programs))

    def run(self, program: str) -> Execution:
        with self._lock:
            slot = self._slots.pop()
        try:
            return self._run(program, slot)
        finally:
            with self._lock:
                self._slots.append(slot)

    def _command(self, workdir: str, uid: int | None) -> list[str]:
        if self.bwrap is None:  # unsafe: the same limits, no isolation
            return [self.python, "-I", "-S", "-B", os.path.join(workdir, "program.py")]
        prefix = os.path.dirname(os.path.dirname(self.python))  # .../bin/python3 → its prefix
        binds = []
        for path in dict.fromkeys(p for p in (prefix, "/usr", "/lib", "/lib64", "/lib32") if os.path.exists(p)):
            binds += ["--ro-bind", path, path]
        return [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL",
                *binds, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                "--bind", workdir, "/sandbox", "--chdir", "/sandbox", "--clearenv",
                "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox", "--setenv", "LANG", "C.UTF-8",
                "--", self.python, "-I", "-S", "-B", "program.py"]

    def _limits(self, uid: int | None) -> list[str]:
        """`prlimit` (util-linux) setting the limits, then exec'ing the sandbox: no Python runs between our fork
        and the exec (a `preexec_fn` may deadlock beside our threads). The process count is per user: our
        slot's uid when we are root, else ours, whose processes already running are added to it."""
        lim = self.limits
        procs = lim.processes if uid is not None else lim.processes + _processes_of(os.getuid())
        return [self.prlimit, f"--cpu={lim.cpu_s}", f"--as={lim.memory_mb << 20}", f"--fsize={lim.file_mb << 20}",
                f"--nofile={lim.open_files}", f"--nproc={procs}", "--core=0", "--"]

    def _run(self, program: str, slot: int) -> Execution:
        uid = _BASE_UID + slot if os.geteuid() == 0 else None
        workdir = tempfile.mkdtemp(prefix="smoltrain-sandbox-")
        try:
            with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
                f.write(program)
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chown(os.path.join(workdir, "program.py"), uid, uid)
            out = open(os.path.join(workdir, "stdout"), "wb")
            err = open(os.path.join(workdir, "stderr"), "wb")
            t0 = time.perf_counter()
            # the uid is dropped by setpriv, not by Popen(user=...): that would make Popen fork instead of vfork,
            # copying the page tables of a caller holding a model (80 ms per program at 1.5 GB)
            ident = [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if uid is not None else []
            proc = subprocess.Popen(self._limits(uid) + ident + self._command(workdir, uid), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, cwd=workdir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                    start_new_session=True, close_fds=True)
            timed_out, (status, usage) = False, _wait(proc, t0 + self.limits.wall_s)
            if status is None:
                timed_out = True
                _stop(proc)
                status, usage = _wait(proc, None)
            _kill_group(proc)  # a survivor of an unsafe run (the sandbox's PID namespace needs none of this)
            wall = time.perf_counter() - t0
            out.close()
            err.close()
            rc = os.waitstatus_to_exitcode(status)
            if self.bwrap is not None and rc > 128:  # bwrap exits 128 + N when the program died of signal N
                rc = -(rc - 128)
            stdout, stderr = (_tail(os.path.join(workdir, n), self.limits.output_chars) for n in ("stdout", "stderr"))
            return _verdict(rc, timed_out, stdout, stderr, wall, usage.ru_utime + usage.ru_stime, self.limits)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def _processes_of(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                n += 1
        except OSError:
            continue
    return n


def _wait(proc: subprocess.Popen, deadline: float | None):
    """(wait status, rusage) of `proc` (its reaped descendants' CPU time included), or (None, None) when the
    deadline passes first."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG if deadline is not None else 0)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
            return status, usage
        if time.perf_counter() > deadline:
            return None, None
        time.sleep(0.005)


def _stop(proc: subprocess.Popen) -> None:
    """Kill what `proc` started, then `proc`: bwrap's init of the PID namespace dies first (the kernel then kills
    everything in it) and the outer bwrap, still alive, reaps it, so no zombie is left to the machine's init."""
    import psutil

    try:
        for child in psutil.Process(proc.pid).children():
            child.kill()
    except psutil.Error:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: str, n: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 4 * n))
        return f.read().decode("utf-8", "replace")[-n:]


def _verdict(rc: int | None, timed_out: bool, stdout: str, stderr: str, wall: float, cpu: float,
             lim: Limits) -> Execution:
    if timed_out:
        return Execution("timeout", f"wall time over {lim.wall_s:g} s", rc, stdout, stderr, wall)
    if rc == 0:
        return Execution("passed", "", rc, stdout, stderr, wall)
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if rc is not None and rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        if sig in ("SIGXCPU", "SIGKILL") and cpu >= lim.cpu_s * 0.9:
            sig = "SIGXCPU"
        why = {"SIGXCPU": f"CPU time over {lim.cpu_s} s", "SIGKILL": "killed (a limit or a signal)",
               "SIGXFSZ": f"a file over {lim.file_mb} MiB", "SIGSEGV": "segmentation fault"}.get(sig, sig)
        return Execution("killed", why, rc, stdout, stderr, wall)
    if "MemoryError" in last:
        return Execution("killed", f"memory over {lim.memory_mb} MiB ({last})", rc, stdout, stderr, wall)
    if last.startswith("AssertionError"):
        return Execution("failed", last, rc, stdout, stderr, wall)
    return Execution("error", last or f"exit status {rc}", rc, stdout, stderr, wall)
