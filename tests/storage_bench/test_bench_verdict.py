"""Sizes, verdict rules, GPUDirect reasons."""
from __future__ import annotations

import sys

import pytest

from storage.bench import gds
from storage.bench.units import fmt_size, parse_list, parse_size
from storage.bench.verdict import CKPT_BUDGET_S, tier_verdict


def test_sizes():
    assert parse_size("64K") == 65536 and parse_size("8MiB") == 8 << 20 and parse_size("1.5G") == 3 << 29
    assert parse_size("4096") == 4096 and parse_list("1,2,64", int) == [1, 2, 64]
    assert fmt_size(8 << 20) == "8MiB" and fmt_size(1536) == "1.5KiB"
    for bad in ("", "x", "-1K", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def _pt(test, gibs, p99=100.0, size=1 << 20):
    return {"test": test, "mode": "direct", "threads": 4, "io_size": size, "ops": 10, "gib_per_s": gibs,
            "lat_p99_us": p99}


def _tier(kind="local", fs_type="ext4", volatile=False, read=2.0, write=1.0, p99=100.0):
    return {"kind": kind, "fs_type": fs_type, "volatile": volatile, "checkpoint": None,
            "results": [_pt("seq_read", read), _pt("seq_write", write), _pt("rand_read", 0.1, p99, 4096)]}


def test_feeds_need_uses_headroom_and_bytes_per_token():
    ok = tier_verdict(_tier(read=1.0), 100e6, 4.0, None)  # needs 400 MB/s = 0.37 GiB/s -> 2.7x
    assert ok["feeds_need"] is True and "2.7x" in ok["feeds_reason"]
    no = tier_verdict(_tier(read=0.5), 100e6, 4.0, None)  # 1.3x < 2x
    assert no["feeds_need"] is False and no["data_cache"]["fits"] is False
    assert tier_verdict(_tier(), None, None, None)["feeds_need"] is None
    assert "assumed: uncompressed uint16" in tier_verdict(_tier(), 1e6, None, None)["feeds_reason"]


def test_shard_streaming_rate_can_veto():
    v = tier_verdict(_tier(read=10.0), 1e6, 1.5, None, shards={"tokens_per_s": 1.5e6})
    assert v["feeds_need"] is False and "shard streaming" in v["feeds_reason"]


def test_uses():
    assert tier_verdict(_tier(), None, None, None)["data_cache"]["fits"] is True
    slow = tier_verdict(_tier(p99=50_000.0), None, None, None)["data_cache"]
    assert slow["fits"] is False and "p99 50.0 ms" in slow["reason"]
    obj = tier_verdict(_tier(kind="object", fs_type="s3"), None, None, None)
    assert obj["data_cache"]["fits"] is False and obj["checkpoints"]["fits"] is True
    mem = tier_verdict(_tier(fs_type="tmpfs", volatile=True), None, None, None)["checkpoints"]
    assert mem["fits"] is False and "lost on reboot" in mem["reason"]
    big = tier_verdict(_tier(write=0.001), None, None, 10 << 30)["checkpoints"]
    assert big["fits"] is False and f"<= {CKPT_BUDGET_S:g} s" in big["reason"]


def test_gds_reasons(monkeypatch):
    assert gds.probe("s3", "object") == (False, "s3:// is an object store: GDS reads local or GDS-enabled "
                                                "filesystems only")
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import fails as if not installed
    assert gds.probe("ext4", "local") == (False, "kvikio is not installed (pip install '.[gds]')")
