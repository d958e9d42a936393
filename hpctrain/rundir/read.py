"""The one error path of every reader of a run directory.

A run directory is written by programs, but people edit, copy and damage it. Whatever a reader
finds there (bytes that are not UTF-8, JSON that is not an object, a field of the wrong type) ends
as a `RunDirError`: one line naming the file, what is wrong and what to do, exit 2 like any other
bad input (exit codes: docs/architecture.md), never a traceback. A file that does not exist is not an
error: every file of a run is optional until the run has written it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, TypeVar

from hpctrain.errors import ConfigError

T = TypeVar("T")


class RunDirError(ConfigError):
    """A file of a run directory cannot be read as the contract says it is written."""


def damaged(path: Path, what: str) -> RunDirError:
    return RunDirError(f"{path}: {what}; the run directory is damaged (restore or remove that file)")


def decode(path: Path, data: bytes, line: Optional[int] = None) -> str:
    """`data` as UTF-8, or a RunDirError naming the file, the line and the offending byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"line {line}, " if line is not None else ""
        raise damaged(path, f"{where}byte 0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8") from None


def read_text(path: Path) -> Optional[str]:
    """The file as text, or None when it does not exist (or is not a regular file)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise damaged(path, "is a directory, not a file") from None
    except OSError as exc:
        raise RunDirError(f"{path}: cannot read it ({exc.strerror}); check its permissions") from None
    return decode(path, data)


def read_json(path: Path) -> Any:
    """The JSON value in `path`, None when the file does not exist; damaged JSON is a RunDirError."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise damaged(path, f"not JSON ({exc})") from None


def read_json_object(path: Path) -> Optional[dict[str, Any]]:
    data = read_json(path)
    if data is not None and not isinstance(data, dict):
        raise damaged(path, f"holds a JSON {type(data).__name__}, not an object")
    return data


def read_yaml_mapping(path: Path) -> Optional[dict[str, Any]]:
    """A YAML mapping (job.yaml, job.resolved.yaml), None when the file does not exist."""
    import yaml

    text = read_text(path)
    if text is None:
        return None
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise damaged(path, f"{where}not valid YAML") from None
    if not isinstance(data, dict):
        raise damaged(path, f"holds a YAML {type(data).__name__}, not a mapping")
    return data


def _load_yaml(text: str) -> Any:
    """yaml.safe_load, with libyaml's parser when PyYAML has it: the same values, ~8x faster (`status` reads
    a resolved job per run). A text it refuses is read again by the pure-Python parser, whose error (and
    line) is the one reported, as before."""
    import yaml

    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return yaml.safe_load(text)


def field(record: dict[str, Any], key: str, kind: type[T] | tuple[type, ...], path: Path,
          default: Any = None) -> Any:
    """record[key] checked against `kind` (bool is not an int here), or `default` when absent/null."""
    value = record.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise damaged(path, f"field {key!r} is {value!r} ({type(value).__name__}), not {names}")
    return value


def int_list(record: dict[str, Any], key: str, path: Path) -> list[int]:
    """A list of ints (exit codes, rank orders), [] when absent."""
    values = field(record, key, list, path, default=[])
    for value in values:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise damaged(path, f"field {key!r} holds {value!r}, not an integer")
    return values
