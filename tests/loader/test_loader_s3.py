"""Remote datasets: an S3 bucket on moto's server reads as the local copy, also through injected faults."""
from __future__ import annotations

import http.client
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import fsspec
import pytest
import torch


def _upload(local: str, url: str, opts: dict) -> None:
    import s3fs

    fs3 = s3fs.S3FileSystem(**opts)
    for dirpath, _, files in os.walk(local):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), local)
            fs3.put_file(os.path.join(dirpath, f), f"{url[len('s3://'):]}/{rel}")


class FaultProxy:
    """HTTP proxy in front of moto: every `every`-th GET answers 503 SlowDown, the others are delayed."""

    def __init__(self, upstream: str, every: int = 3, delay_s: float = 0.002):
        up = urlparse(upstream)
        self.faults = self.gets = 0
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else delayed ACKs add ~40 ms per response

            def log_message(self, *a):
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "GET":
                    with lock:
                        proxy.gets += 1
                        fail = proxy.gets % every == 0
                    if fail:
                        proxy.faults += 1
                        msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                        self.send_response(503)
                        self.send_header("Content-Length", str(len(msg)))
                        self.end_headers()
                        self.wfile.write(msg)
                        return
                    time.sleep(delay_s)
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = up.netloc
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def local_ds(tmp_path_factory, ld):
    root = str(tmp_path_factory.mktemp("s3src") / "ds")
    ld.make_dataset(root, {"web": 150, "code": 100})
    return root


def _run(loader_factory, ds, steps=6, **kw):
    return [next(x) for x in [loader_factory(ds, G=8, prefetch_threads=4, **kw)] for _ in range(steps)]


def test_s3_dataset_reads_like_local(local_ds, s3_server, s3_bucket, loader_factory):
    url = f"{s3_bucket}/ds"
    _upload(local_ds, url, s3_server["storage_options"])
    ref = _run(loader_factory, local_ds)
    remote = loader_factory(url, G=8, prefetch_threads=4)
    got = [next(remote) for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    m = remote.metrics()
    assert m["bytes_read"] > 0 and m["blocks_read"] > 0
    # a state taken remotely resumes on the local copy (same content, other location)
    local = loader_factory(local_ds, G=8)
    local.load_state_dict(remote.state_dict())
    assert torch.equal(next(local), _run(loader_factory, local_ds, steps=7)[6])


def test_s3_faults_and_latency_are_retried(local_ds, s3_server, s3_bucket, loader_factory, monkeypatch):
    url = f"{s3_bucket}/ds"
    _upload(local_ds, url, s3_server["storage_options"])
    proxy = FaultProxy(s3_server["endpoint_url"], every=3)
    try:
        # botocore backs off for up to seconds per retry; with it off, s3fs and storage.fs retry quickly
        monkeypatch.setitem(fsspec.config.conf, "s3", {**fsspec.config.conf["s3"], "endpoint_url": proxy.url,
                                                       "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}}})
        got = _run(loader_factory, url)
    finally:
        proxy.close()
    assert proxy.faults >= 3, "no fault was injected: the test would prove nothing"
    assert all(torch.equal(a, b) for a, b in zip(_run(loader_factory, local_ds), got))
