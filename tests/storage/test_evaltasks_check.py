"""storage.evaltasks.check_task: the validation `train launch` and `train eval` run before starting workers
refuses exactly what load_task refuses (same message), without reading the package's task files."""
import json

import pytest

from storage import evaltasks
from storage.evaltasks import TaskError, check_task, load_task


def _message(fn, spec):
    with pytest.raises(TaskError) as e:
        fn(spec)
    return str(e.value)


def test_check_refuses_what_load_refuses_with_the_same_message(tmp_path):
    bad = tmp_path / "mine.jsonl"
    bad.write_text(json.dumps({"doc_id": 1, "context": "Q:", "continuation": " a", "label": 0}) + "\n"
                   + json.dumps({"doc_id": 1, "context": "Q:", "continuation": " b", "label": 3}) + "\n")
    specs = ["hellaswagg", "hellaswag:rc_9shot", "mmlu:rc_3shot", "mmlu_nosuch", f"mine={bad}",
             f"gone={tmp_path / 'missing.jsonl'}"]
    for spec in specs:
        assert _message(check_task, spec) == _message(load_task, spec), spec
    assert f"{bad}:2" in _message(check_task, f"mine={bad}")


def test_the_package_task_files_are_not_read(monkeypatch, tmp_path):
    def unread(*args, **kwargs):
        raise AssertionError("read a task file")

    monkeypatch.setattr(evaltasks, "read_requests", unread)
    for spec in ("hellaswag", "arc_easy:rc_5shot", "mmlu", "mmlu_anatomy:rc_5shot"):
        check_task(spec)
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"doc_id": 1, "context": "Q:", "continuation": " a", "label": 0}) + "\n")
    with pytest.raises(AssertionError):  # a file of the user's is read whole
        check_task(f"mine={mine}")
