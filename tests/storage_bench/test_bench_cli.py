"""`storage bench` end to end on local paths: JSON fields + PNG, tmpfs fallback, bad input, cleanup."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner
from testutil import default_sigint

from storage.bench.report import REQUIRED_FIELDS
from storage.cli import main
from storage.dataset import SourceWriter
from storage.manifest import Manifest, TokenizerInfo, write_manifest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args: str):
    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


def _leftovers(d) -> list[str]:
    return glob.glob(os.path.join(str(d), ".smoltrain-bench-*"))


def make_dataset(root: str, docs: int = 40) -> str:
    rng = np.random.default_rng(0)
    w = SourceWriter(root, "web", "uint16", block_tokens=4096, shard_blocks=4)
    for i in range(docs):
        w.add_document(f"d{i}", np.append(rng.integers(0, 1000, 700), 0).astype(np.uint16))
    info = w.close()
    write_manifest(root, Manifest(TokenizerInfo("tok.json", "0" * 64, 1000, 0, "uint16"), {"web": info}))
    return root


def test_quick_writes_json_with_every_field_and_pngs(tmp_path):
    target, out = tmp_path / "tier", tmp_path / "out"
    target.mkdir()
    ds = make_dataset(str(tmp_path / "ds"))
    r = _bench(str(target), "--quick", "--out", str(out), "--shards", ds, "--checkpoint", "4M",
               "--checkpoint-files", "2", "--need-tokens-per-s", "1000")
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "bench.json").read_text())
    for k in REQUIRED_FIELDS["report"]:
        assert k in rep, k
    (t,) = rep["targets"]
    for k in REQUIRED_FIELDS["target"]:
        assert k in t, k
    assert t["kind"] == "local" and t["target"] == str(target)
    for k in REQUIRED_FIELDS["summary"]:
        assert t["summary"][k] is not None, k
    for k in REQUIRED_FIELDS["verdict"]:
        assert k in t["verdict"], k
    # the verdict from the measured points by the documented rule (storage/bench/verdict.py): the best
    # sequential read and the shard streaming rate must both be >= 2x the need of 1000 tokens/s x the
    # measured bytes per token. A local disk feeds that many times over.
    best_read = max(p["gib_per_s"] for p in t["results"] if p["test"] == "seq_read") * 2**30
    need = 1000 * rep["shards"]["bytes_per_token"]
    assert best_read >= 2 * need and rep["shards"]["tokens_per_s"] >= 2 * 1000
    assert t["verdict"]["feeds_need"] is True
    assert f"= {best_read / need:.1f}x the {need / 2**20:.1f} MiB/s needed" in t["verdict"]["feeds_reason"]
    assert t["verdict"]["bytes_per_token_source"] == "measured by --shards"
    combos = {(p["test"], p["threads"], p["io_size"]) for p in t["results"]}
    assert combos >= {(x, n, s) for x in ("seq_write", "seq_read") for n in (1, 4) for s in (65536, 1 << 20)}
    assert {(n, s) for x, n, s in combos if x == "rand_read"} == {(1, 4096), (4, 4096)}
    for p in t["results"]:
        assert set(REQUIRED_FIELDS["point"]) <= set(p)
        assert p["ops"] > 0 and p["bytes"] == p["ops"] * p["io_size"]
        assert (p["resident_before"] is None) == (p["test"] == "seq_write")
        assert 0 <= p["io_busy"] <= 1 and 0 <= p["cpu_wait"] <= 1 and p["cpu_s"] >= 0
    assert t["cpu_bound"]["note"] and isinstance(t["cpu_bound"]["points"], list)
    assert t["checkpoint"]["total_bytes"] == 4 << 20 and t["checkpoint"]["files"] == 2
    assert not t["gds"]["available"] and t["gds"]["reason"]
    s = rep["shards"]
    assert s["shards"] == 2 and s["blocks"] == 8 and s["tokens"] == 40 * 701 and s["tokens_per_s"] > 0
    assert len(rep["plots"]) == 2
    for png in rep["plots"]:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "verdict" in r.output and "seq_read" in r.output
    assert _leftovers(target) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm tmpfs on this machine")
def test_tmpfs_reports_o_direct_fallback(tmp_path):
    r = _bench("/dev/shm", "--quick", "--threads", "1", "--tests", "seq_read", "--out", str(tmp_path))
    assert r.exit_code == 0, r.output
    (t,) = json.loads((tmp_path / "bench.json").read_text())["targets"]
    assert t["fs_type"] == "tmpfs" and t["volatile"]
    assert t["direct"] == {"supported": False, "requested": True, "reason": t["direct"]["reason"]}
    assert "tmpfs" in t["direct"]["reason"] and "buffered only" in t["direct"]["reason"]
    assert {p["mode"] for p in t["results"]} == {"buffered"}
    assert "eviction is impossible" in t["page_cache"]["note"]
    assert t["verdict"]["checkpoints"]["fits"] is False
    assert "O_DIRECT: tmpfs" in r.output
    assert glob.glob(f"/dev/shm/.smoltrain-bench-{os.getpid()}-*") == []  # in-process run: our pid


def test_missing_path_fails_before_io(tmp_path):
    r = _bench(str(tmp_path / "nope"), "--quick", "--out", str(tmp_path / "out"))
    assert r.exit_code == 2
    assert f"error: {tmp_path / 'nope'}: path does not exist" in r.output
    assert not (tmp_path / "out").exists()


def test_too_little_free_space_fails_before_io(tmp_path):
    r = _bench(str(tmp_path), "--quick", "--file-size", "100T", "--out", str(tmp_path / "out"))
    assert r.exit_code == 2
    assert "too little free space" in r.output and "need 100.0TiB" in r.output
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory that refuses writes even to root: a read-only tmpfs mount, else chattr +i."""
    d = tmp_path / "ro"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True, check=False).returncode == 0:
        yield d
        subprocess.run(["umount", str(d)], check=True)
    elif subprocess.run(["chattr", "+i", str(d)], capture_output=True, check=False).returncode == 0:
        yield d
        subprocess.run(["chattr", "-i", str(d)], check=True)
    else:
        pytest.skip("cannot make a directory read-only here (neither mount nor chattr +i allowed)")


def test_read_only_path_fails_before_io(read_only_dir, tmp_path):
    r = _bench(str(read_only_dir), "--quick", "--out", str(tmp_path / "out"))
    assert r.exit_code == 2
    assert f"error: {read_only_dir}: not writable" in r.output
    assert not (tmp_path / "out").exists()


def test_bad_option_is_a_usage_error(tmp_path):
    r = _bench(str(tmp_path), "--quick", "--sizes", "1000")
    assert r.exit_code == 2 and "not a multiple of 4 KiB" in r.output


def test_a_killed_benchmarks_scratch_is_removed_by_the_next(tmp_path, caplog):
    """SIGKILL leaves a benchmark no chance to clean up: the next one on the host removes the scratch of this
    host's benchmarks whose process is gone (not another host's, not a running one's)."""
    import socket

    target = tmp_path / "tier"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    names = [f".smoltrain-bench-{host}-{gone.stdout.strip()}-0badc0de", f".smoltrain-bench-{host}-{os.getpid()}-1",
             f".smoltrain-bench-otherhost-{gone.stdout.strip()}-2"]
    for n in names:
        (target / n).mkdir(parents=True)
        (target / n / "data.bin").write_bytes(b"x" * 4096)
    r = _bench(str(target), "--quick", "--file-size", "4M", "--tests", "seq_read", "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(target)) == sorted(names[1:])
    assert f"removed 1 stale temporary folder from an interrupted run: {target / names[0]}" in caplog.text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_leaves_no_test_file(tmp_path, sig):
    target = tmp_path / "tier"
    target.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "storage.cli", "bench", str(target), "--file-size", "32M",
                             "--duration", "60", "--threads", "1", "--sizes", "1M", "--tests", "rand_read",
                             "--rand-sizes", "4K", "--modes", "buffered", "--out", str(tmp_path / "out")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=default_sigint)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until the test file exists at full size
            files = glob.glob(str(target / ".smoltrain-bench-*" / "data.bin"))
            if files and os.path.getsize(files[0]) == 32 << 20:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        else:
            pytest.fail("benchmark never created its test file")
        time.sleep(0.5)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted: removed test files" in out
    assert _leftovers(target) == [] and os.listdir(target) == []
