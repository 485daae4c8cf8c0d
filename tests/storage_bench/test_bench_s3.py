"""`storage bench s3://...` against moto's S3 server on 127.0.0.1."""
from __future__ import annotations

import json

import fsspec
import numpy as np
import pytest
from click.testing import CliRunner

from storage.cli import main
from storage.dataset import SourceWriter
from storage.manifest import Manifest, TokenizerInfo, write_manifest
from testutil import require

moto_server = require("moto.server")


@pytest.fixture(scope="module")
def s3_endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(fsspec.config, "conf", {})  # the command sets the endpoint here; keep it out of other tests
    fsys = fsspec.filesystem("s3", endpoint_url=s3_endpoint, skip_instance_cache=True)
    fsys.mkdir("bench-bucket")
    yield fsys
    fsys.rm("bench-bucket", recursive=True)


def test_s3_target_on_moto(bucket, s3_endpoint, tmp_path):
    r = CliRunner().invoke(main, ["bench", "s3://bench-bucket/tier", "--quick", "--threads", "1,2", "--sizes", "1M",
                                  "--file-size", "4M", "--s3-block-size", "5M", "--checkpoint", "2M",
                                  "--checkpoint-files", "2", "--endpoint-url", s3_endpoint, "--out", str(tmp_path)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (t,) = json.loads((tmp_path / "bench.json").read_text())["targets"]
    assert t["kind"] == "object" and t["fs_type"] == "s3"
    assert not t["direct"]["supported"] and "object store" in t["direct"]["reason"]
    assert {(p["test"], p["threads"]) for p in t["results"]} == {
        (x, n) for x in ("seq_write", "seq_read", "rand_read") for n in (1, 2)}
    for p in t["results"]:
        assert p["mode"] == "s3fs" and p["ops"] > 0 and p["lat_p99_us"] >= p["lat_p50_us"] > 0
    assert t["checkpoint"]["total_bytes"] == 2 << 20 and t["checkpoint"]["resident_before_read"] is None
    assert t["verdict"]["data_cache"]["fits"] is False and "object store" in t["verdict"]["data_cache"]["reason"]
    assert "GPU_DIRECT: unavailable" in r.output
    bucket.invalidate_cache()
    assert bucket.find("bench-bucket") == []  # every test object removed


def test_s3_missing_bucket_fails_before_io(bucket, s3_endpoint, tmp_path):
    r = CliRunner().invoke(main, ["bench", "s3://no-such-bucket/x", "--quick", "--endpoint-url", s3_endpoint,
                                  "--out", str(tmp_path / "out")])
    assert r.exit_code == 2
    assert "error: s3://no-such-bucket/x: bucket 'no-such-bucket' does not exist" in r.output


def test_s3_block_size_below_part_minimum_is_refused(bucket, s3_endpoint, tmp_path):
    r = CliRunner().invoke(main, ["bench", "s3://bench-bucket/x", "--quick", "--s3-block-size", "1M",
                                  "--endpoint-url", s3_endpoint, "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and "5 MiB minimum" in r.output


def test_shards_streamed_from_s3(bucket, s3_endpoint, tmp_path):
    fsspec.config.conf["s3"] = {"endpoint_url": s3_endpoint}
    ds = "s3://bench-bucket/ds"
    w = SourceWriter(ds, "web", "uint16", block_tokens=2048, shard_blocks=2)
    for i in range(12):
        w.add_document(f"d{i}", np.append(np.arange(500) % 97, 0).astype(np.uint16))
    write_manifest(ds, Manifest(TokenizerInfo("t.json", "0" * 64, 1000, 0, "uint16"), {"web": w.close()}))
    target = tmp_path / "tier"
    target.mkdir()
    r = CliRunner().invoke(main, ["bench", str(target), "--quick", "--threads", "1", "--sizes", "64K", "--tests",
                                  "seq_read", "--shards", ds, "--endpoint-url", s3_endpoint, "--out", str(tmp_path)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "bench.json").read_text())["shards"]
    assert (s["shards"], s["tokens"], s["resident_before"]) == (2, 12 * 501, None)
    assert s["bytes_per_token"] > 0 and "shards s3://bench-bucket/ds" in r.output
