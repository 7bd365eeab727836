"""Typed configs from YAML with dotted command-line overrides (litgpt / torchtune style).

``load_config(TrainConfig, "configs/synthetic.yaml", ["--trainer.max_steps", "300"])`` builds the
nested dataclasses, checks every key and type, and names the offending key and the fix on error.

Two schema helpers: ``Annotated[dict, FieldsOf(SomeDataclass)]`` types a mapping of some of that dataclass's
fields (overrides), each value checked against its field's type; a dataclass's ``MOVED`` class attribute
(``{"old_key": "where it lives now"}``) turns a removed key into an error that names its new place.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or override does not match the schema."""


@dataclasses.dataclass(frozen=True)
class FieldsOf:
    """Marker for ``Annotated[dict, FieldsOf(cls)]``: a mapping of some fields of dataclass ``cls``."""

    cls: type


def _unknown_keys(where: str, unknown: list[str], names: list[str], owner: str) -> ConfigError:
    """The error for keys not in ``names``, with a "did you mean" for near misses."""
    close = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
    hint = "; ".join(f"did you mean {m[0]!r} for {k!r}?" for k, m in close.items() if m)
    return ConfigError(f"{where}: unknown key(s) {unknown}{f' ({hint})' if hint else ''}; "
                       f"valid keys of {owner}: {names}")


def _check_fields_of(value: Any, cls: type, where: str) -> dict:
    """A mapping of some of ``cls``'s fields, each value checked (and converted) to its field's type."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {value!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise _unknown_keys(where, unknown, names, cls.__name__)
    return {k: _check_type(v, hints[k], f"{where}.{k}") for k, v in value.items()}


def _check_type(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Annotated:
        marks = [m for m in tp.__metadata__ if isinstance(m, FieldsOf)]
        return _check_fields_of(value, marks[0].cls, where) if marks else _check_type(value, tp.__origin__, where)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _check_type(value, arm, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} is not a {tp}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected null, got {value!r}")
        return None
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        arm = args[0] if args else Any
        items = [_check_type(v, arm, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value


def from_dict(cls, data: dict | None, where: str = "config"):
    """Build dataclass ``cls`` from a mapping; unknown keys and wrong types raise ConfigError."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    moved = getattr(cls, "MOVED", {})
    stale = sorted(set(data) & set(moved))
    if stale:
        raise ConfigError(f"{where}.{stale[0]} is no longer a setting: set {moved[stale[0]]}")
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise _unknown_keys(where, unknown, names, cls.__name__)
    return cls(**{k: _check_type(v, hints[k], f"{where}.{k}") for k, v in data.items()})


def parse_overrides(args: list[str]) -> dict:
    """["--a.b", "3", "--c=x"] -> {"a": {"b": 3}, "c": "x"}; values parsed as YAML scalars."""
    out: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"override {arg!r} must look like --section.key VALUE or --section.key=VALUE")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} needs a value")
            key, raw = arg[2:], args[i + 1]
            i += 2
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(raw)
    return out


def merge_dicts(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` laid over it, nested dicts merged key by key (neither input is changed)."""
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = merge_dicts(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None):
    """Dataclass ``cls`` from a YAML file (optional) plus dotted overrides."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
    return from_dict(cls, merge_dicts(data, parse_overrides(overrides or [])), where=str(path or "config"))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
