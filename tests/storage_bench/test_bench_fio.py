"""`--vs-fio`: the equivalent fio jobs and a side-by-side run on the same file."""
from __future__ import annotations

import json

from click.testing import CliRunner

from storage.bench import fio
from storage.cli import main
from testutil import require_tool


def test_job_args_match_our_points():
    seq = fio.job_args("/d/f", 64 << 20, "seq_read", "direct", 4, 1 << 20, 2.0)
    assert "--rw=read" in seq and "--direct=1" in seq and "--numjobs=4" in seq and "--ioengine=psync" in seq
    assert f"--size={16 << 20}" in seq and f"--offset_increment={16 << 20}" in seq and "--time_based" not in seq
    rnd = fio.job_args("/d/f", 64 << 20, "rand_read", "buffered", 32, 4096, 0.2)
    assert "--rw=randread" in rnd and "--direct=0" in rnd and "--time_based" in rnd and "--runtime=1s" in rnd
    assert f"--size={64 << 20}" in rnd and "--norandommap" in rnd
    assert "--end_fsync=1" in fio.job_args("/d/f", 64 << 20, "seq_write", "direct", 1, 1 << 20, 1)


def test_vs_fio_side_by_side(tmp_path):
    require_tool("fio")
    target = tmp_path / "tier"
    target.mkdir()
    r = CliRunner().invoke(main, ["bench", str(target), "--quick", "--threads", "1,2", "--sizes", "1M",
                                  "--tests", "seq_read", "--vs-fio", "--out", str(tmp_path / "out")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (t,) = json.loads((tmp_path / "out" / "bench.json").read_text())["targets"]
    assert [(f["test"], f["threads"], f["io_size"]) for f in t["fio"]] == [("seq_read", 1, 1 << 20),
                                                                          ("rand_read", 2, 4096)]
    for f in t["fio"]:
        assert f["fio"]["bytes"] > 0 and f["ours"]["bytes"] > 0 and f["ratio"] > 0
        assert f["fio"]["command"].startswith("fio ") and str(target) in f["fio"]["command"]
    assert r.output.count("| ratio ") == 2  # the side-by-side table lines
    assert list(target.iterdir()) == []


def test_vs_fio_without_fio_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(fio.shutil, "which", lambda name: None)
    r = CliRunner().invoke(main, ["bench", str(tmp_path), "--quick", "--threads", "1", "--sizes", "1M",
                                  "--tests", "seq_read", "--vs-fio", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    (t,) = json.loads((tmp_path / "out" / "bench.json").read_text())["targets"]
    assert t["fio"] is None and "fio not found on PATH" in t["fio_note"]
