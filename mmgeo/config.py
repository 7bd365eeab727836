"""Typed configs from YAML with dotted command-line overrides (litgpt / torchtune style).

``load_config(TrainConfig, "configs/synthetic.yaml", ["--trainer.max_steps", "300"])`` builds the
nested dataclasses, checks every key and type, and names the offending key and the fix on error.

Two schema helpers: ``Annotated[dict, FieldsOf(SomeDataclass)]`` types a mapping of some of that dataclass's
fields (overrides), each value checked against its field's type; a dataclass's ``MOVED`` class attribute
(``{"old_key": "where it lives now"}``) turns a removed key into an error that names its new place.

The command lines' one error style (train.py, eval.py, ``python -m serve``, ``python -m mmgeo.eval.viz``):
``run_cli(main)`` ends a user's mistake (a missing file, a damaged checkpoint, a bad flag or config value) in one
line ``error: ...`` on stderr and exit status 2, and an unexpected error (a bug) in one line naming its type, exit
status 1; with ``--debug`` or ``MMGEO_DEBUG=1`` the traceback comes first. ``CliParser``: argparse whose usage
errors are that same one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import traceback
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

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


DEBUG_ENV = "MMGEO_DEBUG"  # MMGEO_DEBUG=1 (or --debug): an error shows its traceback
USER_ERROR = 2  # exit status of a user's mistake (argparse's own)
INTERNAL_ERROR = 1  # exit status of an unexpected error
STOPPED = 143  # exit status of a run stopped from outside (128 + SIGTERM, the shell's convention)


class Stopped(Exception):
    """A run stopped from outside (SIGTERM, a killed worker): ``call_cli`` reports its message in one line and
    exits with ``STOPPED``; the message says how to continue."""


FILE_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
PROJECT_PACKAGES = {"mmgeo", "serve"}


class CliParser(argparse.ArgumentParser):
    """argparse with the project's error style: a usage error is one line ``error: ...`` on stderr, exit status 2
    (no usage block), and ``--debug`` (taken off the command line by ``run_cli``) is listed in ``--help``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", help=f"show the traceback of an error (or {DEBUG_ENV}=1)")

    def error(self, message: str) -> NoReturn:
        self.exit(USER_ERROR, f"error: {message} (see {self.prog} --help)\n")


def _raised_in(err: BaseException, roots: list[Path]) -> bool:
    """Whether the innermost frame of ``err``'s traceback is a file under ``roots`` (not an installed package)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    return not {"site-packages", "dist-packages"} & set(path.parts) and any(path.is_relative_to(r) for r in roots)


def is_user_error(err: BaseException, roots: list[Path] | None = None) -> bool:
    """A user's mistake, to be reported in one line: a file missing (or a folder where a file belongs, ...); an
    error type of this project (``ConfigError``, ``GalleryError``, ``UnsafeWeightsError``, ``MissingDownloadError``,
    ``NonFiniteScores``, ...); or a ValueError the project's own code raised with its message (``roots``: the
    project's source folders; default: mmgeo's). Anything else — a ValueError from inside a library included — is
    unexpected: a bug."""
    if isinstance(err, FILE_ERRORS) or type(err).__module__.split(".")[0] in PROJECT_PACKAGES:
        return True
    return isinstance(err, ValueError) and _raised_in(err, roots or [Path(__file__).resolve().parent])


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror and err.filename and str(err).startswith("[Errno"):
        return f"{err.filename}: {err.strerror}"  # open()'s own error, without the errno
    return str(err) or type(err).__name__


def call_cli(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` (default: ``sys.argv[1:]`` less ``--debug``) -> the exit status: ``main``'s if it returns
    an int, else 0; 2 for a user's mistake, reported as one line ``error: <message>`` on stderr (``SystemExit("...")``
    raised with a message, ``is_user_error``); 1 for an unexpected error, one line naming its type and how to see
    the traceback; 130 when interrupted; 143 when stopped from outside (``Stopped``). With ``--debug`` or
    ``MMGEO_DEBUG=1`` the traceback is printed before that line. ``SystemExit`` with a status (argparse's usage
    errors, ``--help``) passes through."""
    argv = list(sys.argv[1:] if argv is None else argv)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end] or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for i, a in enumerate(argv) if i >= end or a != "--debug"]
    module = sys.modules.get(getattr(main, "__module__", ""), None)
    roots = [Path(__file__).resolve().parent] + (
        [Path(module.__file__).resolve().parent] if getattr(module, "__file__", None) else [])
    try:
        status = main(argv)
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            raise
        return _report(err, str(err.code), USER_ERROR, debug)
    except KeyboardInterrupt as err:
        return _report(err, "interrupted", 130, debug)
    except Stopped as err:
        return _report(err, str(err), STOPPED, debug)
    except Exception as err:  # noqa: BLE001 — every error ends in one line (and a status) unless debugging
        if is_user_error(err, roots):
            return _report(err, _message(err), USER_ERROR, debug)
        hint = "" if debug else f" (an unexpected error; rerun with {DEBUG_ENV}=1 or --debug for the traceback)"
        return _report(err, f"{type(err).__name__}: {_message(err).splitlines()[0]}{hint}", INTERNAL_ERROR, debug)
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


def _report(err: BaseException, message: str, status: int, debug: bool) -> int:
    sys.stdout.flush()
    if debug:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    print(f"error: {message}", file=sys.stderr, flush=True)
    return status


def run_cli(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> NoReturn:
    """An entry point's ``if __name__ == "__main__":``: exit with ``call_cli(main, argv)``."""
    sys.exit(call_cli(main, argv))
