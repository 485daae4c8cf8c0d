"""A build killed with SIGKILL mid-way and rerun gives byte-identical shards and manifest."""
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


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not rel.startswith(("_work/", "rejects/")) and rel != "build_report.json":
            out[rel] = p.read_bytes()
    return out


def _run(config: Path, kill_when: Path | None = None) -> bool:
    """Run `datapipe build`; with kill_when, SIGKILL it (the build process alone, as the OOM killer or a
    crash would) as soon as that path exists. True if killed. Its datatrove pool workers must then go too:
    none of the build's process group may be left after a few seconds."""
    cmd = [sys.executable, "-m", "datapipe.cli", "build", str(config), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    if kill_when is None:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]
        return False
    while proc.poll() is None:
        if kill_when.exists() and any(kill_when.iterdir()):
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


@pytest.mark.slow
def test_kill9_then_rerun_is_byte_identical(tmp_path, small_tokenizer):
    fortunes = read_corpus("fortunes", 4000)
    web = [write_jsonl(tmp_path / "in" / f"web{i}.jsonl", fortunes[i::4]) for i in range(4)]
    docs = write_jsonl(tmp_path / "in" / "docs.jsonl", read_corpus("pydoc", 150))
    out = tmp_path / "ds"
    cfg = {"output": str(out), "tokenizer": {"path": small_tokenizer},
           "shards": {"block_tokens": 16384, "shard_blocks": 4},
           "sources": [{"name": "docs", "paths": [docs]},
                       {"name": "web", "paths": web, "filters": [{"type": "gopher_quality",
                                                                  "params": {"min_doc_words": 5}}]}]}
    config = tmp_path / "build.yaml"
    config.write_text(yaml.safe_dump(cfg))

    _run(config)
    reference = _files(out)
    assert any(k.endswith(".tar") for k in reference) and "manifest.json" in reference
    shutil.move(out, tmp_path / "reference")

    killed = [_run(config, kill_when=out / "_work" / "logs" / "scan" / "completions"),
              _run(config, kill_when=out / "_work" / "logs" / "tokenize" / "completions")]
    assert all(killed), f"a build finished before it could be killed: {killed}"
    assert not (out / "manifest.json").exists()
    _run(config)
    assert _files(out) == reference
