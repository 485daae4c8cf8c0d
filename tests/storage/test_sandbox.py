"""The sandbox for generated programs against hostile programs: after each, no file outside its working
directory changed, no process of it left, a listener on 127.0.0.1 received nothing, and the run went on
and recorded why it ended."""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from storage.sandbox import Limits, Sandbox, SandboxUnavailable
from testutil import REPO, unavailable

if shutil.which("bwrap") is None:
    unavailable("bubblewrap (bwrap) is not installed", "run make sysdeps as root (apt-get install bubblewrap)",
                installed_here=os.geteuid() == 0 and shutil.which("apt-get") is not None)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(Limits(cpu_s=2, wall_s=4, memory_mb=512, file_mb=1, processes=32), workers=2)


@pytest.fixture()
def canaries(tmp_path):
    """Files a program must neither change nor read: in the project, in the home directory, in /tmp."""
    home = Path(os.path.expanduser("~")) / f".smoltrain-canary-{os.getpid()}"
    paths = [REPO / f".canary-{os.getpid()}", home, tmp_path / "secret.txt"]
    for p in paths:
        p.write_text("canary 4711\n")
    yield paths
    for p in paths:
        p.unlink(missing_ok=True)


@pytest.fixture()
def listener():
    """A TCP listener on 127.0.0.1; `got` lists what reached it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    got, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            got.append(conn.recv(100) or b"<connected>")
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], got
    stop.set()
    t.join()
    srv.close()


def _sandboxed_left() -> list[psutil.Process]:
    """Processes of the sandbox's slot users (uid 64000+) still alive."""
    return [p for p in psutil.process_iter(["uids", "cmdline"]) if p.info["uids"] and p.info["uids"].real >= 64_000]


HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "memory bomb": "x = []\nwhile True:\n    x.append(bytearray(50 << 20))\n",
    "endless loop": "while True:\n    pass\n",
    "sleeps forever": "import time\ntime.sleep(3600)\n",
    "writes home and project": "import os\nfor p in [os.path.expanduser('~/pwned'), '{repo}/pwned', '/tmp/pwned']:\n"
                               "    open(p, 'w').write('x')\n",
    "overwrites canaries": "for p in {canaries!r}:\n    open(p, 'w').write('pwned')\n",
    "reads outside": "print(open({secret!r}).read())\n",
    "connects to 127.0.0.1": "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                              "s.sendall(b'stolen')\n",
    "kills its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)\n"
                        "import time\ntime.sleep(1)\n",
    "double-forking daemon": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                             "        time.sleep(60)\n        open('/sandbox/late', 'w').write('x')\n    os._exit(0)\n"
                             "print('parent done')\n",
    "signal-ignoring child": "import os, signal, time\nif os.fork() == 0:\n"
                             "    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
                             "        signal.signal(s, signal.SIG_IGN)\n    time.sleep(60)\nprint('parent done')\n",
    "huge output": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_programs_are_contained(sandbox, canaries, listener, name):
    port, got = listener
    program = HOSTILE[name].format(repo=REPO, canaries=[str(p) for p in canaries], secret=str(canaries[2]), port=port)
    before = {p: p.read_text() for p in canaries}
    t0 = time.perf_counter()
    res = sandbox.run(program)
    assert time.perf_counter() - t0 < 15
    assert res.status != "passed" or name in ("double-forking daemon", "signal-ignoring child", "kills its parent")
    assert res.reason or res.status == "passed", res
    assert {p: p.read_text() for p in canaries} == before
    assert "canary" not in res.stdout
    for p in (Path(os.path.expanduser("~/pwned")), REPO / "pwned", Path("/tmp/pwned")):
        assert not p.exists(), p
    time.sleep(0.3)
    assert _sandboxed_left() == []
    assert got == []
    assert sandbox.run("print(6 * 7)").stdout.strip() == "42"  # the sandbox goes on after each


def test_verdicts_and_parallel_runs():
    # a wall limit far above the CPU limit: on a loaded machine a busy loop gets its 2 CPU-seconds late, and
    # must still be the CPU limit's kill, not a wall-time timeout
    sandbox = Sandbox(Limits(cpu_s=2, wall_s=60, memory_mb=512, file_mb=1, processes=32), workers=2)
    programs = ["assert sum([1, 2]) == 3\n", "assert sum([1, 2]) == 4, 'wrong sum'\n", "raise KeyError('k')\n",
                "import sys\nsys.exit(3)\n", "while True:\n    pass\n"] * 2
    res = sandbox.map(programs)
    assert [r.status for r in res[:5]] == ["passed", "failed", "error", "error", "killed"]
    assert res[1].reason == "AssertionError: wrong sum" and res[2].reason == "KeyError: 'k'"
    assert res[4].reason == "CPU time over 2 s" and [r.status for r in res[5:]] == [r.status for r in res[:5]]


def test_no_bwrap_refuses_unless_unsafe(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "bwrap" else "/usr/bin/" + name)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap.*--unsafe-exec"):
        Sandbox()
    assert Sandbox(unsafe=True).run("print(1)").stdout.strip() == "1"
