"""Shared CLI plumbing: the `CONFIG --set a.b=c --print-config` pattern and friendly error exits."""
from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

import click

from storage import config as cfgmod

T = TypeVar("T")


def config_options(schema: type, config_required: bool = True) -> Callable:
    """Decorate a click command taking CONFIG + --set/--print-config; it receives `cfg` (typed).

    With --print-config the resolved config is printed as YAML and the command exits.
    """

    def deco(fn: Callable) -> Callable:
        @click.argument("config_path", metavar="CONFIG", required=config_required,
                        type=click.Path(dir_okay=False))
        @click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                      help="Override a config key with a dotted path, e.g. --set train.steps=100 (repeatable).")
        @click.option("--print-config", is_flag=True, help="Print the resolved config as YAML and exit.")
        @functools.wraps(fn)
        def wrapper(config_path, overrides, print_config, **kwargs):
            try:
                cfg = cfgmod.load(schema, config_path, overrides)
            except cfgmod.ConfigError as e:
                raise click.UsageError(str(e)) from None
            if print_config:
                click.echo(cfgmod.dump(cfg), nl=False)
                return None
            return fn(cfg=cfg, config_path=config_path, **kwargs)

        return wrapper

    return deco


def die(msg: str, code: int = 1) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)
