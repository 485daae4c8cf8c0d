"""Metrics sinks (JSONL + TensorBoard + console), memory stats and `train plot` on a written run dir."""
import json

from click.testing import CliRunner

from train.cli import main
from train.config import MonitorConfig
from train.monitor.metrics import Sinks, format_record, memory_stats


def _rec(step, **kw):
    return {"step": step, "loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0,
            "step_time_s": 0.5, "data_wait_share": 0.01, "mfu": None, "rss_gib": 0.5, "mem_fraction": 0.1,
            "skipped_steps": 0, **kw}


def test_sinks_write_jsonl_tensorboard_and_console(tmp_path, capsys):
    s = Sinks(tmp_path, MonitorConfig(tensorboard=True))
    for i in range(1, 4):
        s.log(_rec(i, mfu=0.25 if i == 3 else None))
    s.event(3, "warning", "MFU 25.0% is below 30%")
    s.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("step") for x in lines] == [1, 2, 3, 3] and lines[-1]["event"] == "warning"
    assert any((tmp_path / "tb").iterdir())
    out = capsys.readouterr()
    assert "loss 4.7000" in out.out and "MFU 25.0%" in out.out and "[warning] step 3" in out.err
    Sinks(tmp_path / "other", MonitorConfig(tensorboard=True), enabled=False).log(_rec(1))  # non-zero ranks write nothing
    assert not (tmp_path / "other").exists()


def test_memory_stats_cpu():
    m = memory_stats()
    assert m["rss_gib"] > 0 and 0 < m["fraction"] < 1


def test_format_record_shows_skips_and_comm_share():
    assert "skipped 2" in format_record(_rec(5, skipped_steps=2))
    assert "comm" not in format_record(_rec(5))
    assert "| comm 12.5% |" in format_record(_rec(5, comm_share=0.125))


def test_plot_writes_png(tmp_path):
    s = Sinks(tmp_path, MonitorConfig(tensorboard=False))
    for i in range(1, 6):
        s.log(_rec(i, mfu=0.3))
    s.close()
    r = CliRunner().invoke(main, ["plot", str(tmp_path), "--out", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    r = CliRunner().invoke(main, ["plot", str(tmp_path / "nope")])
    assert r.exit_code != 0
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(main, ["plot", str(tmp_path / "empty")])
    assert r.exit_code != 0 and "no metrics" in r.output
