"""`storage inspect` and `storage verify` on good and corrupt datasets, as a user runs them."""
from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from storage.cli import main


def test_inspect_reports_counts(random_dataset):
    root, m = random_dataset
    res = CliRunner().invoke(main, ["inspect", root, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["tokenizer"]["dtype"] == "uint16"
    for name, src in m.sources.items():
        assert out["sources"][name]["tokens"] == src.tokens == sum(s.tokens for s in src.shards)
        assert out["sources"][name]["documents"] == src.documents
    text = CliRunner().invoke(main, ["inspect", root]).output
    assert "web" in text and f"{m.total_tokens:,}" in text


def test_verify_ok_then_names_corrupt_shard_and_member(random_dataset):
    root, m = random_dataset
    ok = subprocess.run([sys.executable, "-m", "storage.cli", "verify", root], capture_output=True, text=True)
    assert ok.returncode == 0 and f"ok: {sum(len(s.shards) for s in m.sources.values())} shards" in ok.stdout
    shard = m.sources["code"].shards[1]
    path = f"{root}/{shard.path}"
    data = bytearray(open(path, "rb").read())
    data[512 + 40] ^= 0x01  # inside the first block's LZ4 frame
    open(path, "wb").write(bytes(data))
    bad = subprocess.run([sys.executable, "-m", "storage.cli", "verify", root], capture_output=True, text=True)
    assert bad.returncode == 1
    assert path in bad.stderr and "shard-000001_000000.tokens.lz4" in bad.stderr, bad.stderr


def test_verify_catches_sha_mismatch_with_intact_frames(random_dataset):
    root, m = random_dataset
    path = f"{root}/{m.sources['web'].shards[0].path}"
    with open(path, "ab") as f:
        f.write(b"\0" * 512)  # still a valid tar, but not the bytes the manifest vouches for
    res = CliRunner().invoke(main, ["verify", root])
    assert res.exit_code == 1 and "sha256 mismatch" in res.output and path in res.output
