"""`storage.lifecycle.run_main`: a command's process ends as Python's exit would (exit code, traceback,
threads, atexit handlers, buffered output, temporary folders), without the interpreter's teardown."""
from __future__ import annotations

import subprocess
import sys

import pytest

from testutil import REPO

_COMMAND = """
import atexit, sys, tempfile, threading, time
from pathlib import Path
from storage.lifecycle import run_main

out = Path(sys.argv[1])
kind = sys.argv[2]


def late_writer():
    time.sleep(0.3)
    (out / "thread").write_text("joined")


def main():
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    keep = tempfile.TemporaryDirectory(dir=out)  # removed by its weakref.finalize at exit
    (out / "tmpdir").write_text(keep.name)
    threading.Thread(target=late_writer).start()  # non-daemon: exit waits for it
    sys.stdout.write("x" * 100_000 + "end")      # a pipe: block-buffered, flushed at exit
    sys.stderr.write("to stderr")
    globals()["keep"] = keep
    if kind == "raise":
        raise ValueError("broken input")
    if kind == "sysexit-str":
        sys.exit("a message")
    return {"zero": 0, "none": None, "three": 3}[kind]


run_main(main)
"""


@pytest.mark.parametrize("kind, code", [("zero", 0), ("none", 0), ("three", 3), ("raise", 1), ("sysexit-str", 1)])
def test_run_main_exits_like_python(tmp_path, kind, code):
    script = tmp_path / "command.py"
    script.write_text(_COMMAND)
    res = subprocess.run([sys.executable, str(script), str(tmp_path), kind], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={"PYTHONPATH": str(REPO)})
    assert res.returncode == code, res.stderr
    assert res.stdout == "x" * 100_000 + "end"
    assert res.stderr.startswith("to stderr")
    if kind == "raise":
        assert "Traceback" in res.stderr and "ValueError: broken input" in res.stderr
    if kind == "sysexit-str":
        assert res.stderr.rstrip().endswith("a message")
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"
    tmpdir = (tmp_path / "tmpdir").read_text()
    assert tmpdir.startswith(str(tmp_path)) and not (tmp_path / tmpdir).exists()
