"""Shared fixtures: a small random dataset, a moto S3 server and bucket; the order test files run in."""
from __future__ import annotations

import os

import fsspec
import pytest

# Two test workers share the cores: each process (and every CLI or torchrun rank it starts) computes on one
# thread, where OpenMP's default (one per core) left threads spinning on cores the other worker was using.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from testutil import free_port, write_random_dataset  # noqa: E402
from storage.manifest import Manifest  # noqa: E402

# Files that take longest (`make test`'s --durations), started first: xdist (--dist loadfile, its reordering
# off in the Makefile) hands files out in collection order; its own reordering (most tests first) left the
# one-test demo file (~6 min) for last, with the other worker idle beside it (one fresh-clone run each:
# tests 26:18 before, 25:23 after on a slow VM; the demo's own 2 processes now share the cores longer).
LONGEST_FIRST = ("test_demo.py", "test_eval_e2e.py", "test_train_parallel.py", "test_fault_injection.py",
                 "test_ckpt_resume.py", "test_sft_train.py", "test_dpo_train.py", "test_ckpt_merge.py",
                 "test_distill_train.py", "test_train_init.py")


def pytest_collection_modifyitems(items):
    """The files of LONGEST_FIRST first, in that order, then the others by their number of tests (xdist's own
    order); tests keep their order within a file."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def key(path):
        if path.name in LONGEST_FIRST:
            return LONGEST_FIRST.index(path.name), 0
        return len(LONGEST_FIRST), -len(files[path])
    items[:] = [item for path in sorted(files, key=key) for item in files[path]]


@pytest.fixture
def random_dataset(tmp_path) -> tuple[str, Manifest]:
    root = str(tmp_path / "ds")
    return root, write_random_dataset(root, {"web": 120, "code": 60})


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1; yields storage_options for fsspec/s3fs."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # fsspec applies conf["s3"] to every s3:// filesystem in this process; the FSSPEC_S3_* variables do
    # the same for subprocesses (CLIs, torchrun workers).
    opts = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    env = {"FSSPEC_S3_KEY": "testing", "FSSPEC_S3_SECRET": "testing", "FSSPEC_S3_ENDPOINT_URL": endpoint,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old_conf, old_env = dict(fsspec.config.conf.get("s3", {})), {k: os.environ.get(k) for k in env}
    fsspec.config.conf["s3"] = {**old_conf, **opts}
    os.environ.update(env)
    try:
        yield {"endpoint_url": endpoint, "storage_options": opts}
    finally:
        fsspec.config.conf["s3"] = old_conf
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the moto server: yields its s3:// URL."""
    import uuid

    import s3fs

    name = f"test-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**s3_server["storage_options"]).mkdir(name)
    return f"s3://{name}"
