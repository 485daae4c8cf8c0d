"""Local engine pieces: O_DIRECT probe and fallback, page-cache eviction and residency, thread runner."""
from __future__ import annotations

import errno
import os

import pytest

from storage.bench import io as bio
from storage.bench.target import mount_of, resolve


def test_probe_direct_reports_refusal(tmp_path, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(bio.os, "open", refusing)
    ok, why = bio.probe_direct(str(tmp_path), "ext4")
    assert not ok
    assert why == f"open(O_DIRECT) refused by ext4 in {tmp_path}: EINVAL (Invalid argument): measured buffered only"
    assert os.listdir(tmp_path) == []


def test_probe_direct_on_memory_fs_never_claims_bypass(tmp_path):
    ok, why = bio.probe_direct(str(tmp_path), "tmpfs")
    assert not ok and "tmpfs" in why


def test_evict_and_residency(tmp_path):
    _, fstype = mount_of(str(tmp_path))
    if fstype in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {fstype}: pages cannot be evicted there")
    p = tmp_path / "f"
    p.write_bytes(os.urandom(4 << 20))
    with open(p, "rb") as f:
        f.read()
    assert bio.resident_fraction(str(p)) == 1.0
    bio.evict(str(p))
    assert bio.resident_fraction(str(p)) < 0.05
    assert bio.resident_fraction(str(tmp_path / "f")) is not None
    (tmp_path / "empty").write_bytes(b"")
    assert bio.resident_fraction(str(tmp_path / "empty")) == 0.0


def test_engine_points_count_what_they_did(tmp_path):
    e = bio.LocalEngine(str(tmp_path / "data.bin"), 4 << 20)
    e.prepare(direct=False)
    assert os.path.getsize(tmp_path / "data.bin") == 4 << 20
    w = e.seq_write(2, 1 << 20, "buffered", 5.0)
    assert (w.test, w.threads, w.bytes, w.ops) == ("seq_write", 2, 4 << 20, 4)
    with open(tmp_path / "data.bin", "rb") as f:  # warm: a read point must start from an evicted file
        f.read()
    r = e.seq_read(4, 64 << 10, "buffered", 5.0)
    assert (r.bytes, r.ops) == (4 << 20, 64)
    if mount_of(str(tmp_path))[1] in ("tmpfs", "ramfs"):  # file data lives in the page cache there
        assert r.resident_before == r.resident_after == 1.0
    else:  # evicted before the read; the buffered read brings the whole file back into the cache
        assert r.resident_before < 0.05 and r.resident_after > 0.9, (r.resident_before, r.resident_after)
    rr = e.rand_read(1, 4096, "buffered", 0.05)
    assert rr.ops > 0 and rr.bytes == rr.ops * 4096 and rr.lat_p99_us >= rr.lat_p50_us
    with pytest.raises(ValueError, match="too small for 8 threads"):
        e.seq_read(8, 1 << 20, "buffered", 1.0)


def test_run_threads_propagates_worker_errors():
    def work(i, deadline, stop):
        if i == 1:
            raise OSError("disk on fire")
        stop.wait(5)
        return 0, []

    with pytest.raises(OSError, match="disk on fire"):
        bio.run_threads(3, work, 1.0)


def test_resolve_targets(tmp_path):
    t = resolve(str(tmp_path))
    assert t.kind == "local" and t.fs_type != "unknown" and t.path == str(tmp_path)
    o = resolve("s3://bucket/prefix/")
    assert (o.kind, o.fs_type, o.url, o.mount) == ("object", "s3", "s3://bucket/prefix", "bucket")
