"""Typed YAML configs shared by every CLI: load, validate, override with `--set a.b=c`, dump.

A config schema is a tree of dataclasses. Unknown keys and wrong types are errors that name the key,
the file and the expected type, so a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit its schema."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"list of {_type_name(get_args(tp)[0])}" if get_args(tp) else "list"
    if origin is dict:
        return f"mapping of str to {_type_name(get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _fail(where: str, key: str, msg: str) -> typing.NoReturn:
    raise ConfigError(f"{where}: key '{key}': {msg}")


def _convert(value: Any, tp: Any, key: str, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) and isinstance(value, dict):
            return _build(inner[0], value, where, key + ".")  # an optional section: its errors name their key
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key, where)
            except ConfigError:
                continue
        _fail(where, key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        _fail(where, key, f"expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            _fail(where, key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return _build(tp, value, where, key + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            _fail(where, key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        (item_tp,) = get_args(tp)[:1] or (Any,)
        if item_tp in (int, str) and all(type(v) is item_tp for v in value):
            return list(value)  # the common case (a manifest's per-block token counts), checked at C speed
        return [_convert(v, item_tp, f"{key}.{i}", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _fail(where, key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        _, val_tp = get_args(tp) or (str, Any)
        return {str(k): _convert(v, val_tp, f"{key}.{k}", where) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise TypeError(f"unsupported config type {tp!r} for key {key}")
    _fail(where, key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The evaluated field types of a dataclass, once per class: get_type_hints evaluates every annotation
    string on each call, which made parsing a manifest of many shards cost ~0.1 s at loader start-up."""
    return get_type_hints(cls)


def _build(cls: type[T], data: dict, where: str, prefix: str = "") -> T:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        _fail(where, prefix + str(unknown[0]),
              f"unknown key; known keys here: {', '.join(sorted(fields))}")
    kwargs = {name: _convert(v, hints[name], prefix + name, where) for name, v in data.items()}
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        _fail(where, prefix + missing[0], f"required key is missing ({_type_name(hints[missing[0]])})")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return obj


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[int(part)]
            continue
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, (dict, list)):
            raise ConfigError(f"--set {dotted}: '{'.'.join(parts[:i + 1])}' is not a mapping")
        node = nxt
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` → ("a.b", YAML value of c)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.steps=100")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {e}") from None


def load_yaml(path: str | os.PathLike) -> dict:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def from_dict(cls: type[T], data: dict, overrides: Sequence[str] = (), where: str = "<config>") -> T:
    data = to_plain(data)
    for ov in overrides:
        key, value = parse_override(ov)
        _set_dotted(data, key, value)
    if overrides:
        where = f"{where} (with --set {' '.join(overrides)})"
    return _build(cls, data, where)


def load(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Read YAML `path` (or only defaults when None), apply overrides, validate into `cls`."""
    data = load_yaml(path) if path else {}
    return from_dict(cls, data, overrides, where=str(path) if path else "<defaults>")


def to_plain(obj: Any) -> Any:
    """Dataclass tree → plain dicts/lists (for YAML/JSON)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def dump(obj: Any) -> str:
    return yaml.safe_dump(to_plain(obj), sort_keys=False, default_flow_style=False)


def save(obj: Any, path: str | os.PathLike, shared: bool = False) -> None:
    """Write the resolved config (atomically) next to a run's output; `shared`: several processes may
    write it at once (storage.atomic.AtomicFile)."""
    from storage import atomic

    atomic.write_bytes(str(path), dump(obj).encode(), shared)
