"""The test helpers that decide a verdict: run_killable's kill report, the CI rule of require and
require_root."""
from __future__ import annotations

import sys
import time

import psutil
import pytest

import testutil
from testutil import run_killable


def test_run_killable_reports_a_real_kill(tmp_path):
    t0 = time.time()
    assert run_killable([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log",
                        kill_when=lambda: time.time() - t0 > 0.2) == "killed"


def test_run_killable_kills_workers_in_their_own_session(tmp_path):
    """As torchrun starts its workers: a child in a new session, out of reach of the group kill."""
    pid_file = tmp_path / "worker.pid"
    script = ("import subprocess, sys, time; "
              "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
              f"open({str(pid_file)!r}, 'w').write(str(w.pid)); time.sleep(60)")
    assert run_killable([sys.executable, "-c", script], tmp_path / "log", kill_when=pid_file.exists) == "killed"
    worker = int(pid_file.read_text())
    deadline = time.time() + 5
    while psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE:
        assert time.time() < deadline, "the worker outlived the kill"
        time.sleep(0.05)


def test_run_killable_reports_a_process_that_finished_first(tmp_path):
    log = tmp_path / "log"
    # kill_when turns True only after the process has exited by itself (not yet reaped): kill -9 then has
    # nothing to kill, and the exit status (3, not -9) says so
    assert run_killable(["sh", "-c", "sleep 0.2; exit 3"], log, kill_when=lambda: time.sleep(1) or True) \
        == "finished before the kill (exit status 3)"
    # kill_when never turned True while it ran
    assert run_killable(["sh", "-c", "exit 0"], log, kill_when=lambda: False) == "finished before the kill (exit status 0)"
    assert "finished by itself (exit status 3)" in log.read_text()
    assert run_killable(["sh", "-c", "exit 4"], log) == 4


def _outcome(fn, *args, **kw) -> tuple[type, str]:
    """(Failed or Skipped, message) that fn raised: caught here, so a skip cannot pass for the test's own."""
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as ei:
        fn(*args, **kw)
    return ei.type, str(ei.value)


@pytest.mark.parametrize("ci", [False, True])
def test_require_skips_or_fails_under_ci(monkeypatch, ci):
    monkeypatch.setattr(testutil, "CI", ci)
    monkeypatch.setitem(sys.modules, "spacy", None)  # import fails as if not installed
    expect = pytest.fail.Exception if ci else pytest.skip.Exception
    kind, msg = _outcome(testutil.require, "spacy")
    assert kind is expect and "dev dependency spacy is not installed" in msg and "run make install" in msg
    assert msg.startswith("CI: ") == ci
    # not installed by the dev extra on this platform: a skip, even under CI
    assert _outcome(testutil.require, "spacy", installed_here=False)[0] is pytest.skip.Exception
    monkeypatch.setattr(testutil, "CORPORA", testutil.CORPORA / "no-such-dir")
    kind, msg = _outcome(testutil.corpus_path, "fortunes")
    assert kind is expect and "fortunes.jsonl.gz is absent" in msg
    assert testutil.require("json").dumps([1]) == "[1]"


@pytest.mark.parametrize("ci", [False, True])
def test_require_root_skips_or_fails_under_ci(monkeypatch, ci):
    monkeypatch.setattr(testutil, "CI", ci)
    monkeypatch.setattr(testutil.os, "geteuid", lambda: 1000)
    kind, msg = _outcome(testutil.require_root, "the test Slurm cluster")
    assert kind is (pytest.fail.Exception if ci else pytest.skip.Exception)
    assert "the test Slurm cluster needs root, and this is uid 1000" in msg and msg.startswith("CI: ") == ci
    monkeypatch.setattr(testutil.os, "geteuid", lambda: 0)
    assert testutil.require_root("the test Slurm cluster") is None


_MIDDLE = """
import subprocess, sys
sys.path.insert(0, {tests!r})
import testutil
child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
                         stdout=subprocess.PIPE, text=True,
                         preexec_fn=testutil.default_sigint if sys.argv[1] == "1" else None)
child.stdout.readline()
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.parametrize("reset", [False, True])
def test_default_sigint_lets_a_background_jobs_child_see_sigint(tmp_path, reset):
    """A non-interactive shell starts a background job (`make test &`) with SIGINT ignored, and children
    inherit it: a child started with `default_sigint` dies of SIGINT, one started without it does not."""
    import os
    import signal
    import subprocess

    middle = tmp_path / "middle.py"
    middle.write_text(_MIDDLE.format(tests=str(testutil.REPO / "tests")))
    job = subprocess.Popen(["bash", "-c", f'"{sys.executable}" {middle} {int(reset)} & wait $!'],
                           stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(job.stdout.readline()))
        os.kill(child.pid, signal.SIGINT)
        try:
            child.wait(timeout=10 if reset else 1)
            died = True
        except psutil.TimeoutExpired:
            died = False
        assert died == reset, "SIGINT reached the child" if died else "the child ignored SIGINT"
    finally:
        for proc in psutil.Process(job.pid).children(recursive=True):
            proc.kill()
        job.kill()
        job.wait()
