"""`make demo`'s script, shortened: build → TP=2 train with a stop, an auto-resume and in-loop evaluation
→ eval of every checkpoint and its table → HF export → generation → storage bench, all through the real
CLIs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testutil import REPO

pytestmark = pytest.mark.slow


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    res = subprocess.run([sys.executable, "-m", "tools.demo", "--out", str(out), "--steps", "30"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    assert "resumed at step 20" in res.stdout + res.stderr
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert len(manifest["sources"]) == 2 and len(manifest["mix"]) == 2
    steps = [json.loads(line)["step"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps[-1] == 30 and 20 in steps
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / "hf" / f).exists(), f
    assert (out / "run" / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "run" / "eval.png").read_bytes()[:4] == b"\x89PNG"
    evals = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
             if '"kind": "eval"' in line]
    assert [e["step"] for e in evals] == [30]  # eval.every 150 > 30 steps: only after the last step
    assert {"val/all/loss", "val/all/bpb", "eval/piqa/acc_norm"} <= set(evals[0])
    table = [ln.split() for ln in res.stdout.splitlines()  # `train eval --table` rows (not `ckpt list`'s)
             if ln.startswith("step_") and ln.split()[1].isdigit()]
    assert [row[:2] for row in table] == [["step_00000020", "20"], ["step_00000030", "30"]]
    res30 = json.loads((out / "run" / "eval" / "step_00000030.json").read_text())
    assert float(table[1][3]) == pytest.approx(res30["metrics"]["val/all/loss"], abs=1e-4)
    assert json.loads((out / "storage" / "bench.json").read_text())
    assert "→" in res.stdout and "Outputs:" in res.stdout
