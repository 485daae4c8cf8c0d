"""A build killed with SIGKILL while it writes a shard, rerun (2 workers), killed again in its last stages and
rerun to the end leaves the uninterrupted build's whole output tree, hidden files included (tools.outtree):
the killed write's temporary shard is removed and counted by the rerun, never published, and no process of
a killed build stays behind."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from testutil import read_corpus, write_jsonl

from tools.outtree import BUILD_VOLATILE, differences, tree


def _run(config: Path, log: Path, kill_when=None, workers: int = 1) -> bool:
    """Run `datapipe build` (output appended to `log`); with kill_when, SIGKILL the build process alone (as
    the OOM killer or a crash would) as soon as kill_when() is true. True if killed. With several workers
    its datatrove Manager and pool processes must then go too: none of the build's process group may be
    left after a few seconds."""
    cmd = [sys.executable, "-m", "datapipe.cli", "build", str(config), "--quiet", "--workers", str(workers)]
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if kill_when is None:
            assert proc.wait(timeout=300) == 0, log.read_text()[-2000:]
            return False
        while proc.poll() is None:
            if kill_when():
                proc.kill()
                proc.wait()
                _assert_group_gone(proc.pid)
                return True
            time.sleep(0.005)
    return False


def _assert_group_gone(pgid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    ps = subprocess.run(["ps", "-e", "-o", "pgid=,pid=,args="], check=False, capture_output=True, text=True).stdout
    left = "\n".join(line for line in ps.splitlines() if line.split()[0] == str(pgid))
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError(f"processes of the killed build still running after {timeout:.0f} s:\n{left}")


def _writing_a_shard(out: Path) -> list[str]:
    return [p.name for src in ("docs", "web") if (out / src).is_dir() for p in (out / src).iterdir()
            if p.name.startswith(".tmp-shard-")]


@pytest.mark.slow
def test_kill9_then_rerun_is_byte_identical(tmp_path, small_tokenizer):
    fortunes = read_corpus("fortunes", 4000)
    web = [write_jsonl(tmp_path / "in" / f"web{i}.jsonl", fortunes[i::4]) for i in range(4)]
    docs = write_jsonl(tmp_path / "in" / "docs.jsonl", read_corpus("pydoc", 150))
    out, log = tmp_path / "ds", tmp_path / "build.log"
    cfg = {"output": str(out), "tokenizer": {"path": small_tokenizer},
           "shards": {"block_tokens": 16384, "shard_blocks": 4},
           "sources": [{"name": "docs", "paths": [docs]},
                       {"name": "web", "paths": web, "filters": [{"type": "gopher_quality",
                                                                  "params": {"min_doc_words": 5}}]}]}
    config = tmp_path / "build.yaml"
    config.write_text(yaml.safe_dump(cfg))

    _run(config, log)
    reference = tree(str(out), BUILD_VOLATILE)
    assert any(k.endswith(".tar") for k in reference) and "manifest.json" in reference
    shutil.move(out, tmp_path / "reference")

    # killed while a tokenize task writes a shard (one worker: the task runs in the build process), so the
    # temporary shard stays behind; then, rerun with 2 workers, in its last stages (validation split, manifest)
    assert _run(config, log, kill_when=lambda: bool(_writing_a_shard(out))), "no shard write was caught"
    left = _writing_a_shard(out)
    assert left, "the killed shard write left no temporary file: nothing to check"
    last = out / "_work" / "logs" / "validation"
    assert _run(config, log, kill_when=last.exists, workers=2), "the build finished before its last stages"
    assert not (out / "manifest.json").exists()
    _run(config, log)
    assert differences(reference, tree(str(out), BUILD_VOLATILE)) == []
    assert "stale temporary file" in log.read_text() and f"{left[0]}" in log.read_text(), log.read_text()[-3000:]
