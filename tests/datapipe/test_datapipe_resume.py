"""A build killed with SIGKILL while it writes a shard, rerun, killed again in its last stage and rerun to the
end leaves the uninterrupted build's whole output tree, hidden files included (tools.outtree): the killed
write's temporary shard is removed and counted by the rerun, never published."""
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


def _run(config: Path, log: Path, kill_when=None, group: bool = False) -> bool:
    """Run `datapipe build` (output appended to `log`); with kill_when, SIGKILL it as soon as kill_when() is
    true: the build process alone, as the OOM killer or a crash would (its datatrove pool workers must then
    go too: none of the build's process group may be left after a few seconds), or with `group` every
    process of the build at once, as a machine failure would. True if killed."""
    cmd = [sys.executable, "-m", "datapipe.cli", "build", str(config), "--quiet", "--workers", "2"]
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if kill_when is None:
            assert proc.wait(timeout=300) == 0, log.read_text()[-2000:]
            return False
        while proc.poll() is None:
            if kill_when():
                os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
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

    # killed (every process at once) while a tokenize task writes a shard: the temporary shard stays behind
    assert _run(config, log, kill_when=lambda: bool(_writing_a_shard(out)), group=True), "no shard write was caught"
    left = _writing_a_shard(out)
    assert left, "the killed shard write left no temporary file: nothing to check"
    # then (the build process alone) in its last stages: validation split, then the manifest
    last = out / "_work" / "logs" / "validation"
    assert _run(config, log, kill_when=last.exists), "the build finished before its last stages could be killed"
    assert not (out / "manifest.json").exists()
    _run(config, log)
    assert differences(reference, tree(str(out), BUILD_VOLATILE)) == []
    assert "stale temporary file" in log.read_text() and f"{left[0]}" in log.read_text(), log.read_text()[-3000:]
