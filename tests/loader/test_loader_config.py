"""LoaderConfig through storage.config, old manifests without block sizes, and `storage bench-loader`."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from storage import config as cfgmod
from storage.loader import LoaderConfig


def test_config_loads_validates_and_names_bad_keys(tmp_path):
    path = tmp_path / "loader.yaml"
    path.write_text("dataset: /data/ds\nseq_len: 4096\ncorruption: quarantine\n")
    cfg = cfgmod.load(LoaderConfig, path, ["prefetch_threads=32"])
    assert (cfg.seq_len, cfg.corruption, cfg.prefetch_threads) == (4096, "quarantine", 32)
    with pytest.raises(cfgmod.ConfigError, match="prefetch_thread"):
        cfgmod.load(LoaderConfig, path, ["prefetch_thread=3"])
    with pytest.raises(cfgmod.ConfigError, match="corruption"):
        cfgmod.load(LoaderConfig, path, ["corruption=skip"])
    with pytest.raises(cfgmod.ConfigError, match="seq_len"):
        cfgmod.load(LoaderConfig, path, ["seq_len=0"])


def test_manifest_without_block_sizes_reads_them_from_the_blocks(tmp_path, ld, loader_factory):
    root = str(tmp_path / "ds")
    ld.make_dataset(root, {"web": 100, "code": 80})
    ref = ld.take(loader_factory(root), 4)
    mpath = os.path.join(root, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    for src in m["sources"].values():
        for sh in src["shards"]:
            assert sh.pop("block_tokens")
    with open(mpath, "w") as f:
        json.dump(m, f)
    got = ld.take(loader_factory(root), 4)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_bench_loader_command(mixed_ds):
    from storage.cli import main

    res = CliRunner().invoke(main, ["bench-loader", mixed_ds, "--seq-len", "32", "--batch", "16",
                                    "--sequences", "640", "--every", "320", "--threads", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["sequences"] == 640 and len(out["windows"]) == 2 and out["tokens_per_s"] > 0
    assert out["bytes_read"] > 0 and out["rss_mib_last"] > 0


def test_bad_batch_layout_is_refused(mixed_ds, loader_factory):
    with pytest.raises(ValueError, match="not divisible"):
        loader_factory(mixed_ds, G=6, world=4)
    with pytest.raises(ValueError, match="dp_rank"):
        loader_factory(mixed_ds, G=8, rank=2, world=2)
