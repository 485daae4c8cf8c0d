"""`train eval`'s targets and table without a model: LABEL=CHECKPOINT parsing (stages of a training chain
evaluated together), result files named by label, and `--table` over a run dir or a folder of results."""
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from storage.config import ConfigError
from train.checkpoint import layout
from train.cli import main
from train.eval import results


def _ckpt(run: Path, step: int) -> Path:
    path = run / "checkpoints" / layout.ckpt_name(step)
    path.mkdir(parents=True)
    (path / layout.MANIFEST).write_text(json.dumps({"format": layout.FORMAT, "step": step, "kind": "full"}))
    return path


def _rec(name: str, step: int, loss: float, acc: float, label: str | None = None, at: float | None = None) -> dict:
    rec = {"checkpoint": name, "path": f"/x/{name}", "step": step, "consumed_tokens": step * 1000,
           "metrics": {"val/all/loss": loss, "val/all/bpb": loss / 2},
           "tasks": {"piqa": {"metrics": {"acc": acc, "acc_norm": acc + 0.1, "acc_token": acc + 0.2}}}}
    if label:
        rec["label"] = label
    if at is not None:
        rec["evaluated_at"] = at
    return rec


def test_parse_targets(tmp_path):
    pt, sft = tmp_path / "pt", tmp_path / "sft"
    pt20, pt40, sft10 = _ckpt(pt, 20), _ckpt(pt, 40), _ckpt(sft, 10)
    assert results.parse_targets([str(pt)], False) == ([str(pt40)], [None])
    assert results.parse_targets([str(pt)], True) == ([str(pt20), str(pt40)], [None, None])
    ckpts, labels = results.parse_targets([f"pretrain={pt40}", f"sft.v1+b={sft}", str(pt20)], False)
    assert ckpts == [str(pt40), str(sft10), str(pt20)] and labels == ["pretrain", "sft.v1+b", None]
    odd = tmp_path / "a=b"  # an existing path with '=' is a path, not a label
    _ckpt(odd, 5)
    assert results.parse_targets([str(odd)], False)[1] == [None]
    with pytest.raises(ConfigError, match="bad label 'a b'"):
        results.parse_targets([f"a b={pt40}"], False)
    with pytest.raises(ConfigError, match="bad label ''"):
        results.parse_targets([f"={pt40}"], False)
    with pytest.raises(ConfigError, match="no checkpoint after 'x='"):
        results.parse_targets(["x="], False)
    with pytest.raises(ConfigError, match="--all takes a single RUN_DIR"):
        results.parse_targets([str(pt), str(sft)], True)
    with pytest.raises(ConfigError, match="--all does not take a label"):
        results.parse_targets([f"pt={pt}"], True)
    with pytest.raises(ConfigError, match="both write step_00000040.json"):  # same name, from two runs
        results.parse_targets([str(pt40), str(pt)], False)
    with pytest.raises(ConfigError, match="both write a.json"):
        results.parse_targets([f"a={pt40}", f"a={sft10}"], False)
    # the CLI refuses them as usage errors before starting anything
    r = CliRunner().invoke(main, ["eval", str(pt), str(sft), "--all"])
    assert r.exit_code == 2 and "--all takes a single RUN_DIR (2 targets given)" in r.output
    r = CliRunner().invoke(main, ["eval", f"bad/label={pt40}"])
    assert r.exit_code == 2 and "bad label 'bad/label'" in r.output


def test_write_result_names_labeled_records(tmp_path):
    a = results.write_result(str(tmp_path), _rec("step_00000040", 40, 3.0, 0.5, label="pretrain"))
    b = results.write_result(str(tmp_path), _rec("step_00000040", 40, 3.0, 0.5))
    assert Path(a).name == "pretrain.json" and Path(b).name == "step_00000040.json"
    ra, rb = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    assert ra["label"] == "pretrain" and ra["checkpoint"] == "step_00000040" and "label" not in rb
    assert ra["evaluated_at"] <= rb["evaluated_at"]


def _rows(text: str) -> list[list[str]]:
    return [ln.split() for ln in text.splitlines()[1:] if not ln.startswith("(")]


def test_table_of_labeled_folder_is_in_evaluation_order(tmp_path):
    out = tmp_path / "chain-eval"
    out.mkdir()
    recs = [_rec("step_00000450", 450, 3.2, 0.50, "pretrain", 100.0), _rec("step_00000084", 84, 2.9, 0.56, "sft", 101.0),
            _rec("step_00000020", 20, 2.8, 0.58, "dpo", 102.0)]
    for r in recs:
        (out / f"{r['label']}.json").write_text(json.dumps(r))
    (out / "eval.json").write_text(json.dumps({"hf_folder": "/hf", "tasks": {}}))  # not a `train eval` record
    text = results.table(str(out))
    assert text.splitlines()[0].split()[:5] == ["label", "step", "tokens", "val", "loss"]
    rows = _rows(text)
    assert [r[:2] for r in rows] == [["pretrain", "450"], ["sft", "84"], ["dpo", "20"]]  # not by step or name
    assert rows[1][3:] == ["2.9000", "1.450", "0.660", "0.660"]  # acc_norm by default
    for metric, want in (("acc", "0.560"), ("acc_norm", "0.660"), ("acc_token", "0.760")):
        r = CliRunner().invoke(main, ["eval", "--table", str(out), "--metric", metric])
        assert r.exit_code == 0 and [x[0] for x in _rows(r.output)] == ["pretrain", "sft", "dpo"]
        assert r.output.splitlines()[0].split()[-2:] == ["mean", metric] and f"({metric};" in r.output
        assert _rows(r.output)[1][5:] == [want, want], (metric, r.output)


def test_table_of_run_dir_unchanged(tmp_path):
    ev = tmp_path / "run" / "eval"
    ev.mkdir(parents=True)
    for step, at in ((40, 1.0), (20, 2.0), (100, None)):  # evaluated out of order; an old record without time
        (ev / f"{layout.ckpt_name(step)}.json").write_text(json.dumps(_rec(layout.ckpt_name(step), step, 3, 0.5,
                                                                             at=at)))
    text = results.table(str(tmp_path / "run"))
    assert text.splitlines()[0].split()[0] == "checkpoint"
    assert [r[0] for r in _rows(text)] == ["step_00000020", "step_00000040", "step_00000100"]
    assert [r[0] for r in _rows(results.table(str(ev)))] == ["step_00000020", "step_00000040", "step_00000100"]
    with pytest.raises(FileNotFoundError, match="no evaluation results"):
        results.table(str(tmp_path / "empty"))
