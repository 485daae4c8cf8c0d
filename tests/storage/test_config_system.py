"""The shared typed-config system: the messages a user sees for bad keys, types and overrides."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import click
import pytest
from click.testing import CliRunner

from storage import config
from storage.cliutil import config_options
from storage.config import ConfigError


@dataclass
class Optim:
    lr: float = 3e-4
    schedule: Literal["cosine", "wsd"] = "cosine"


@dataclass
class Run:
    name: str = "run"
    steps: int = 10
    optim: Optim = field(default_factory=Optim)
    sources: dict[str, float] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    resume: bool | None = None

    def validate(self) -> None:
        if self.steps <= 0:
            raise ConfigError(f"key 'steps': must be > 0, got {self.steps}")


def _write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_key_file_and_known_keys(tmp_path):
    p = _write(tmp_path, "optim:\n  lr: 0.1\n  sheduler: wsd\n")
    with pytest.raises(ConfigError) as ei:
        config.load(Run, p)
    assert str(ei.value) == (f"{p}: key 'optim.sheduler': unknown key; known keys here: lr, schedule")


def test_wrong_type_names_expected_type(tmp_path):
    p = _write(tmp_path, "steps: ten\n")
    with pytest.raises(ConfigError) as ei:
        config.load(Run, p)
    assert str(ei.value) == f"{p}: key 'steps': expected int, got str 'ten'"


def test_literal_and_nested_types(tmp_path):
    p = _write(tmp_path, "optim: {schedule: linear}\n")
    with pytest.raises(ConfigError, match=r"key 'optim.schedule': expected one of 'cosine', 'wsd', got 'linear'"):
        config.load(Run, p)
    p = _write(tmp_path, "sources: {web: heavy}\n")
    with pytest.raises(ConfigError, match=r"key 'sources.web': expected float"):
        config.load(Run, p)


def test_overrides_are_typed_and_validated(tmp_path):
    p = _write(tmp_path, "steps: 5\n")
    cfg = config.load(Run, p, ["optim.lr=0.01", "sources.web=0.7", "tags=[a, b]", "resume=true"])
    assert (cfg.optim.lr, cfg.sources, cfg.tags, cfg.resume, cfg.steps) == (0.01, {"web": 0.7}, ["a", "b"], True, 5)
    with pytest.raises(ConfigError, match=r"with --set steps=0\): key 'steps': must be > 0, got 0"):
        config.load(Run, p, ["steps=0"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        config.load(Run, p, ["steps"])


def test_dump_round_trips(tmp_path):
    cfg = config.load(Run, None, ["optim.schedule=wsd", "tags=[x]"])
    config.save(cfg, tmp_path / "resolved.yaml")
    assert config.load(Run, tmp_path / "resolved.yaml") == cfg


def test_cli_shows_the_error_and_prints_config(tmp_path):
    @click.command()
    @config_options(Run)
    def cmd(cfg, config_path):
        click.echo(f"steps={cfg.steps}")

    p = _write(tmp_path, "stepz: 3\n")
    res = CliRunner().invoke(cmd, [str(p)])
    assert res.exit_code == 2 and f"{p}: key 'stepz': unknown key" in res.output
    p = _write(tmp_path, "steps: 3\n")
    res = CliRunner().invoke(cmd, [str(p), "--set", "steps=4", "--print-config"])
    assert res.exit_code == 0 and "steps: 4" in res.output and "schedule: cosine" in res.output
    assert CliRunner().invoke(cmd, [str(p)]).output.strip() == "steps=3"


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.yaml: config file not found"):
        config.load(Run, tmp_path / "nope.yaml")


def test_float_in_exponent_notation_without_dot(tmp_path):
    """PyYAML reads `1e-3` as a string (YAML 1.1); a float key still takes it, an int key does not."""
    p = _write(tmp_path, "optim: {lr: 1e-3}\n")
    assert config.load(Run, p).optim.lr == 1e-3
    with pytest.raises(ConfigError, match=r"key 'steps': expected int, got str '1e3'"):
        config.load(Run, _write(tmp_path, "steps: 1e3\n"))
