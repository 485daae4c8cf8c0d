"""storage.atomic, the one rule for temporary files: a rerun reuses (and counts) its predecessor's leftover,
the owner's sweep removes and counts the rest, folders appear whole, two writers never publish a mix, and
on S3 an aborted or interrupted upload leaves no object and no unfinished multipart upload."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from storage import atomic

REPO = Path(__file__).resolve().parents[2]


def _tree(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_rerun_reuses_the_temporary_name_and_counts_the_leftover(tmp_path, caplog):
    (tmp_path / ".tmp-a.json").write_bytes(b"half of an interrupted wri")
    atomic.write_bytes(str(tmp_path / "a.json"), b"{}")
    assert _tree(tmp_path) == ["a.json"] and (tmp_path / "a.json").read_bytes() == b"{}"
    assert f"removed 1 stale temporary file from an interrupted run: {tmp_path}/.tmp-a.json" in caplog.text


def test_sweep_removes_and_counts_every_leftover_and_nothing_else(tmp_path, caplog):
    for rel in (".tmp-shard-00000-0000.tar", "docs/.tmp-shard-00001-0000.tar.idx", "docs/shard.tar", ".hidden",
                "_work/.tmp-step_2/x/y.bin", "_work/a.npy"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    assert atomic.sweep(str(tmp_path)) == 3
    assert _tree(tmp_path) == [".hidden", "_work/a.npy", "docs/shard.tar"]
    assert (f"removed 2 stale temporary files and 1 stale temporary folder from an interrupted run under "
            f"{tmp_path}: .tmp-shard-00000-0000.tar, docs/.tmp-shard-00001-0000.tar.idx, _work/.tmp-step_2") \
        in caplog.text
    assert atomic.sweep(str(tmp_path)) == 0


def test_atomic_dir_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(KeyError):
        with atomic.atomic_dir(str(out)) as tmp:
            (tmp_path / tmp / "model.safetensors").write_bytes(b"w")
            raise KeyError("interrupted")
    assert os.listdir(tmp_path) == []
    with atomic.atomic_dir(str(out)) as tmp:
        os.makedirs(os.path.join(tmp, "sub"))
        for rel in ("config.json", "sub/t.json"):
            with open(os.path.join(tmp, rel), "w") as f:
                f.write("new")
    assert _tree(out) == ["config.json", "sub/t.json"] and os.listdir(tmp_path) == ["hf"]
    (out / "README").write_text("mine")  # an existing folder: files replaced one by one, others kept
    with atomic.atomic_dir(str(out)) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("newer")
    assert _tree(out) == ["README", "config.json", "sub/t.json"] and (out / "config.json").read_text() == "newer"
    assert os.listdir(tmp_path) == ["hf"]


def test_two_writers_of_one_file_never_publish_a_mix(tmp_path):
    path = str(tmp_path / "config.yaml")
    a = atomic.AtomicFile(path)
    a.file.write(b"a" * 10)
    b = atomic.AtomicFile(path)  # takes the temporary name over (it looks like a leftover)
    b.file.write(b"b" * 10)
    with pytest.raises(RuntimeError, match="two writers of one file at once"):
        a.commit()  # would otherwise rename b's half-written file into place
    assert not os.path.exists(path)
    b.file.write(b"b" * 10)
    b.commit()
    assert open(path, "rb").read() == b"b" * 20 and _tree(tmp_path) == ["config.yaml"]
    # `shared`: processes writing the same bytes at once (each node's launcher writes the run's config.yaml)
    code = f"from storage import atomic\nfor _ in range(100): atomic.write_bytes({path!r}, b'same' * 999, shared=True)"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert _tree(tmp_path) == ["config.yaml"] and open(path, "rb").read() == b"same" * 999


def test_object_store_upload_aborted_and_interrupted_ones_cleaned_up(s3_bucket, caplog):
    fsys, root = fsspec.core.url_to_fs(s3_bucket)
    bucket = root.strip("/")

    def pending() -> list[str]:
        return sorted(u["Key"] for u in fsys.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []))

    af = atomic.AtomicFile(f"{s3_bucket}/ds/web/shard-000000.tar")
    af.file.blocksize = 5 << 20  # S3's smallest part: the upload turns multipart after 5 MiB
    af.file.write(os.urandom(6 << 20))
    assert pending() == ["ds/web/shard-000000.tar"]
    af.abort()
    assert pending() == [] and not fsys.exists(f"{bucket}/ds/web/shard-000000.tar")

    # a run killed mid-upload leaves its multipart upload behind; the next run's sweep of its prefix aborts it
    for key in ("ds/web/shard-000001.tar", "other/x.bin"):
        fsys.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    assert atomic.sweep(f"{s3_bucket}/ds") == 1
    assert pending() == ["other/x.bin"]
    assert f"aborted 1 unfinished multipart upload from an interrupted run under {s3_bucket}/ds" in caplog.text
