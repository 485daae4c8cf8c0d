"""Offload to S3 (moto server on 127.0.0.1), local deletion only after the remote verifies, pull-back
resume; export to a Hugging Face Llama folder with logits matching ours."""
from __future__ import annotations

import importlib.util
import os
import shutil

import fsspec
import pytest
import torch
from click.testing import CliRunner
from testutil import require

from train.checkpoint import layout
from train.checkpoint.offload import Offloader, pull_newest

LOCAL = fsspec.filesystem("file")


def _fake(root, step, kind="full", base=None):
    tmp = layout.tmp_dir_for(str(root), step)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "data.bin"), "wb") as f:
        f.write(os.urandom(3000))
    return layout.commit(tmp, str(root), step, kind, base, {})


def test_offload_verifies_then_prunes_local_and_pulls_back(tmp_path, s3_bucket):
    url = f"{s3_bucket}/run1"
    off = Offloader(url, str(tmp_path), keep_local=1, keep_last=10, full_every=4, keep_full_every=0)
    for step, kind, base in [(2, "full", None), (4, "full", None), (6, "incremental", "step_00000004")]:
        _fake(tmp_path, step, kind, base)
        off.submit(layout.ckpt_name(step))
    off.close()
    assert off.errors == []
    fs, root = fsspec.core.url_to_fs(url)
    assert [c.name for c in layout.list_checkpoints(fs, root)] == ["step_00000002", "step_00000004", "step_00000006"]
    assert fs.cat_file(f"{root}/latest").decode().strip() == "step_00000006"
    from train.checkpoint.cli import ckpt

    r = CliRunner().invoke(ckpt, ["verify", url])
    assert r.exit_code == 0 and r.output.count("ok") == 3, r.output
    r = CliRunner().invoke(ckpt, ["list", url])
    assert "step_00000006    incremental  step_00000004" in r.output and "latest" in r.output, r.output
    # keep_local=1: the newest stays, with the base it needs; step_2 went only after its remote copy verified.
    assert layout.checkpoint_names(LOCAL, str(tmp_path)) == ["step_00000004", "step_00000006"]

    shutil.rmtree(tmp_path / "step_00000004")
    shutil.rmtree(tmp_path / "step_00000006")
    fs.pipe_file(f"{root}/step_00000006/data.bin", b"tampered")  # newest remote copy broken → skipped
    assert pull_newest(url, str(tmp_path)) == "step_00000004"
    assert layout.verify(LOCAL, str(tmp_path), "step_00000004") == []


def test_an_interrupted_runs_remote_leftovers_are_removed_and_counted(tmp_path, s3_bucket, caplog):
    """A run killed mid-offload leaves a remote folder without its manifest (uploaded last) and an
    unfinished multipart upload (billed until aborted): the next run's offloader removes both, first."""
    url = f"{s3_bucket}/run"
    fs, root = fsspec.core.url_to_fs(url)
    off = Offloader(url, str(tmp_path), keep_local=5, keep_last=10, full_every=4, keep_full_every=0)
    _fake(tmp_path, 2)
    off.submit("step_00000002")
    off.close()
    fs.pipe_file(f"{root}/step_00000004/data.bin", b"half an upload")
    bucket, key = root.split("/", 1)
    fs.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{key}/step_00000004/tensors/rank00000.bin")
    off = Offloader(url, str(tmp_path), keep_local=5, keep_last=10, full_every=4, keep_full_every=0)
    off.close()
    fs.invalidate_cache()
    assert layout.checkpoint_names(fs, root) == ["step_00000002"] and off.errors == []
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    assert f"aborted 1 unfinished multipart upload from an interrupted run under {url}" in caplog.text
    assert f"removed 1 incomplete remote checkpoint upload from an interrupted run under {url}" in caplog.text


def test_failed_upload_keeps_local_copies(tmp_path, s3_server):
    off = Offloader("s3://no-such-bucket-xyz/run", str(tmp_path), keep_local=1, keep_last=10, full_every=4,
                    keep_full_every=0)
    for step in (2, 4):
        _fake(tmp_path, step)
        off.submit(layout.ckpt_name(step))
    off.close()
    assert len(off.errors) == 2 and "step_00000002" in off.errors[0]
    assert layout.checkpoint_names(LOCAL, str(tmp_path)) == ["step_00000002", "step_00000004"]


@pytest.mark.slow
def test_offload_resume_from_s3_and_export_to_transformers(tmp_path, s3_bucket):
    require("transformers")
    spec = importlib.util.spec_from_file_location(  # the torchrun helper lives next to this file
        "ckpt_resume_helpers", os.path.join(os.path.dirname(__file__), "test_ckpt_resume.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    run_worker = helpers.run_worker
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from train.checkpoint.cli import ckpt

    url = f"{s3_bucket}/run"
    run = tmp_path / "run"
    common = ["--full-every", "6", "--incremental-every", "2", "--offload-url", url, "--keep-local", "1"]
    first = run_worker(run, 10, nproc=1, extra=[*common, "--dump-logits", str(tmp_path / "logits.pt")])
    assert first["failed"] == []
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    remote = [c.name for c in layout.list_checkpoints(fs, root)]
    assert remote == ["step_00000002", "step_00000004", "step_00000006", "step_00000008", "step_00000010"]
    assert layout.checkpoint_names(LOCAL, str(run / "ckpt")) == ["step_00000006", "step_00000010"]

    # Export the newest (incremental on step_6) and compare logits with the trained megatron model.
    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "hf"
    r = CliRunner().invoke(ckpt, ["export", str(run / "ckpt" / "step_00000010"), str(out),
                                  "--tokenizer", str(tmp_path / "tokenizer.json")])
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json"]
    ours = torch.load(tmp_path / "logits.pt")
    model = LlamaForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        theirs = model(ours["tokens"]).logits
    assert theirs.shape == ours["logits"].shape
    assert (theirs - ours["logits"]).abs().max().item() < 1e-4
    assert PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json")).encode("hello world") == [1, 2]

    # No local checkpoint and the newest remote gone: resume pulls step_8 (incremental) + its base.
    shutil.rmtree(run / "ckpt")
    fs.rm(f"{root}/step_00000010", recursive=True)
    second = run_worker(run, 10, nproc=1, extra=[*common, "--resume"])
    assert second["start"] == 8
    for s in ("9", "10"):
        assert second["steps"][s] == first["steps"][s]
