"""tools/gpu_check.py on a machine without a GPU: it says so and exits 0; every command line it would run
is valid (`train launch --dry-run` on its generated configs); the parts that need no GPU, or only
decline without one, run their code paths; the docs section is replaced between its markers."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import yaml

from testutil import REPO
from tools import gpu_check
from tools import gpu_check_parts as parts


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would measure")
def test_without_gpu_says_so_and_exits_0(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--dir", str(tmp_path), "--no-docs"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "no CUDA GPU: nothing to measure"


def test_plan_writes_configs_that_train_launch_accepts(tmp_path, capsys):
    assert gpu_check.main(["--plan", "--dir", str(tmp_path), "--gpu-gib", "139"]) == 0
    out = capsys.readouterr().out
    modes = parts.recompute_modes()
    for preset in parts.PRESETS:
        for rc in modes:
            cfg = yaml.safe_load((tmp_path / f"{preset}-{rc}.yaml").read_text())
            assert cfg["model"]["preset"] == preset and cfg["debug"]["synthetic_data"] and cfg["precision"] == "bf16"
            assert f"{preset}-{rc}: micro-batch" in out and "--dry-run → exit 0" in out
            # the dry run resolved and wrote the config into the run dir
            resolved = yaml.safe_load((tmp_path / f"run-{preset}-{rc}" / "config.yaml").read_text())
            assert resolved["model"].get("recompute", "none") == rc
    assert "-m tools.gpu_check_parts nccl-worker" in out


def test_parts_without_gpu_run_or_decline(tmp_path):
    ctx = {"dir": tmp_path, "device": "cpu", "gpus": 0, "loader_tokens": 100_000}
    ds = parts.make_dataset(tmp_path / "ds", ctx["loader_tokens"])
    got = parts.loader_rate(ds, "cpu", "python", 0.3, seq_len=128, batch=4)
    assert got["batches"] > 0 and got["tokens_per_s"] > 0 and not got["on_device"]
    for fn in (parts.nccl, parts.checkpoint):
        with pytest.raises(parts.Skip):
            fn(ctx, 5)
    try:
        parts.gds(ctx, 5)  # kvikio absent or no CUDA driver here: declines with the reason
    except parts.Skip as e:
        assert str(e)
    res = gpu_check.run_part(lambda c, s: (_ for _ in ()).throw(ValueError("boom")), ctx, 1)
    assert res["status"] == "failed" and "boom" in res["reason"]


def test_final_save_and_docs_section(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000010" / "manifest.json").write_text(
        json.dumps({"stall_s": 0.5, "tensor_bytes": {"written": 2 << 30}}))
    (run / "logs").mkdir()
    t = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t + 4)) + ",500"
    (run / "logs" / "rank0.log").write_text(
        f"{stamp} INFO train.checkpoint: checkpoint step_00000010 (full) committed: tensors ...\n")
    save = parts.final_save(run, t)
    assert save["bytes"] == 2 << 30 and save["stall_s"] == 0.5 and 3.4 < save["committed_after_s"] < 5.6
    report = {"date": "2026-12-05", "command": "python -m tools.gpu_check", "seconds": 400, "json": "x.json",
              "device": {"name": "NVIDIA H200", "gpus": 1, "gib": 139.8, "torch": "2.x", "cuda": "12.8", "te": True,
                         "cpus": 16},
              "parts": {"train": {"status": "ok", "results": {"runs": [
                  {"run": "1.7b-none", "micro_batch": 4, "seq_len": 4096, "tokens_per_s": 40000.0, "mfu": 0.47,
                   "peak_alloc_gib": 60.0, "est_tokens_per_s": 38000.0, "tokens_vs_est": 1.05, "est_mfu": 0.45,
                   "est_memory_gib": 58.0, "memory_vs_est": 1.03, "checkpoint": save},
                  {"run": "1.7b-selective", "skipped": "no time left in the part's budget"}]}},
                  "checkpoint": {"status": "ok", "results": {"target": "/nvme (ext4 at /)", "saves": {"1.7b-none": save}}},
                  "gds": {"status": "skipped", "reason": "kvikio is not installed"}}}
    section = gpu_check.render(report)
    assert "| 1.7b-none | 4 × 4096 | 40,000 |" in section and "gds: skipped: kvikio is not installed" in section
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro\n\n{gpu_check.BEGIN}\nold\n{gpu_check.END}\n\n## later\n")
    gpu_check.write_docs(section, doc)
    gpu_check.write_docs(section, doc)  # a rerun replaces, never duplicates
    text = doc.read_text()
    assert text.count(gpu_check.BEGIN) == 1 and "old" not in text and text.endswith("## later\n")
    assert text.count("## GPU check") == 1
