"""Safe YAML reading that remembers the line of every key.

PyYAML composes the document into nodes (which keep their marks); we build the Python values
ourselves so that we can reject duplicate keys, non-string keys, custom tags, alias bombs
("billion laughs") and huge files, and map each dotted path to its line for error messages.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hpctrain.errors import ConfigError

# PyYAML's pure reader (yaml/reader.py `Reader.NON_PRINTABLE`, PyYAML 5.1-6.0), which _check_depth's scanner
# runs, compiles at import a negated class that spans all of Unicode: sre builds its bitmap in Python, ~58 M
# instructions and ~5 ms, a twentieth of `hpctrain validate` (issue 23 item 8). While yaml is imported here,
# that one pattern is compiled from the same set written as what it leaves out (the C0 and C1 controls but
# tab, LF, CR and NEL; DEL; the surrogates; U+FFFE and U+FFFF), which matches the same characters at the same
# places (tests/test_config_schema.py compares the two over every code point) and compiles in ~0.1 ms.
_YAML_NON_PRINTABLE = '[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010ffff]'
NON_PRINTABLE = r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x84\x86-\x9f\ud800-\udfff\ufffe\uffff]"


@contextmanager
def _non_printable_from_its_complement() -> Iterator[None]:
    compile_ = re.compile

    def compile(pattern: Any, flags: Any = 0) -> Any:
        return compile_(NON_PRINTABLE if pattern == _YAML_NON_PRINTABLE and flags == 0 else pattern, flags)

    re.compile = compile
    try:
        yield
    finally:
        re.compile = compile_


with _non_printable_from_its_complement():
    import yaml

MAX_FILE_BYTES = 1 << 20  # a job file is a page of YAML; 1 MiB leaves plenty of room
MAX_VALUES = 50_000  # values built, counting every expansion of an alias
MAX_DEPTH = 64  # a job is 4 levels deep; anything far deeper is a mistake or an attack

Path = tuple[str, ...]

try:  # the C composer is ~10x faster on big files; the pure one gives the same nodes
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - libyaml missing
    _Loader = yaml.SafeLoader

_SCALAR = yaml.SafeLoader("")
_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")
# YAML 1.1 (PyYAML) reads 3e-4 as a string; YAML 1.2 and every user read it as a number.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def plain_number(value: Any) -> Any:
    """3e-4 -> 0.0003 for plain (unquoted) scalars; anything else unchanged."""
    if isinstance(value, str) and _EXPONENT_FLOAT.match(value):
        return float(value)
    return value


@dataclass
class Source:
    """Where a job's values came from: a file's lines, and --set overrides."""

    filename: str
    lines: dict[Path, int] = field(default_factory=dict)
    overrides: dict[Path, str] = field(default_factory=dict)
    values: int = 0  # values built so far, file and overrides together, against MAX_VALUES

    def locate(self, path: Path) -> str:
        """`FILE:LINE` (or `--set k=v`) for the deepest known prefix of path."""
        if path and path not in self.lines:  # a key that only an override wrote, e.g. --set model.x.y=1
            for key, text in self.overrides.items():
                if key[: len(path)] == path:
                    return f"--set {text}"
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            if prefix in self.overrides:
                return f"--set {self.overrides[prefix]}"
            if prefix in self.lines:
                return f"{self.filename}:{self.lines[prefix]}"
        return f"{self.filename}:1"


def _fail(filename: str, line: int, message: str) -> ConfigError:
    return ConfigError(f"{filename}:{line}: {message}")


class _Builder:
    """Builds plain values from nodes. With `label` (an override's `--set k=v`), errors are placed
    there and no line numbers are recorded: the lines are the override's, not the file's."""

    def __init__(self, source: Source, label: str = "") -> None:
        self.source = source
        self.label = label

    def _error(self, node: yaml.Node, message: str) -> ConfigError:
        if self.label:
            return ConfigError(f"{self.label}: {message}")
        return _fail(self.source.filename, node.start_mark.line + 1, message)

    def build(self, node: yaml.Node, path: Path) -> Any:
        if len(path) > MAX_DEPTH:
            raise self._error(node, f"{_dotted(path[:3])}...: nested more than {MAX_DEPTH} levels; a job is a "
                              "few levels deep")
        self.source.values += 1
        if self.source.values > MAX_VALUES:
            raise self._error(node, f"{_dotted(path)}: the job expands to more than {MAX_VALUES} values "
                              "(an alias bomb?); write the values out instead of nesting aliases")
        if not self.label:
            self.source.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _COLLECTION_TAGS:
            raise self._error(node, f"{_dotted(path)}: unsupported YAML tag {node.tag}; remove the tag")
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (str(i),)) for i, item in enumerate(node.value)]
        return self._scalar(node, path)

    def _mapping(self, node: yaml.MappingNode, path: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise self._error(key_node, f"{_dotted(path)}: merge keys (<<) are not supported; write the keys out")
            key = self._scalar(key_node, path) if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                raise self._error(key_node, f"{_dotted(path)}: keys must be strings (got {key_node.value!r:.60}); "
                                  "quote the key or fix the indentation")
            if key in out:
                first = self.source.lines.get(path + (key,), "?")
                raise self._error(key_node, f"{_dotted(path + (key,))}: duplicate key (first at line {first}); "
                                  "keep only one")
            if not self.label:
                self.source.lines[path + (key,)] = line
            out[key] = self.build(value_node, path + (key,))
        return out

    def _scalar(self, node: yaml.Node, path: Path) -> Any:
        constructor = yaml.SafeLoader.yaml_constructors.get(node.tag)
        if constructor is None or node.tag in ("tag:yaml.org,2002:binary", "tag:yaml.org,2002:timestamp"):
            raise self._error(node, f"{_dotted(path)}: unsupported YAML tag {node.tag} (got {node.value!r:.60}); "
                              "quote the value to make it a string")
        value = constructor(_SCALAR, node)
        return plain_number(value) if not getattr(node, "style", None) else value  # "" (C) or None: plain


def _dotted(path: Path) -> str:
    return ".".join(path) if path else "(document)"


_OPEN = (yaml.FlowSequenceStartToken, yaml.FlowMappingStartToken, yaml.BlockSequenceStartToken,
         yaml.BlockMappingStartToken)
_CLOSE = (yaml.FlowSequenceEndToken, yaml.FlowMappingEndToken, yaml.BlockEndToken)


def _check_depth(text: str, filename: str, label: str = "") -> None:
    """Refuse deep nesting before composing: the composer recurses (the C one can crash the process).

    The pure-Python scanner does the counting on purpose: libyaml (bundled with PyYAML >= 6.0.4) has
    a nesting limit of its own and reads ahead through flow collections, so with the C scanner its
    error, in its words, would reach the user before ours does.
    """
    depth = 0
    for token in yaml.scan(text, Loader=yaml.SafeLoader):
        if isinstance(token, _OPEN):
            depth += 1
            if depth > 2 * MAX_DEPTH:  # a mapping level can take two tokens (indentless sequences)
                message = f"(document): nested more than {MAX_DEPTH} levels; a job is a few levels deep"
                raise ConfigError(f"{label}: {message}") if label else _fail(filename, token.start_mark.line + 1, message)
        elif isinstance(token, _CLOSE):
            depth -= 1


def parse_yaml(text: str, filename: str) -> tuple[Any, Source]:
    """Parse one YAML document into plain values and a Source with the line of every key."""
    source = Source(filename)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise _fail(filename, 1, f"(document): file is larger than {MAX_FILE_BYTES} bytes; a job file is a short "
                    "YAML mapping")
    try:
        _check_depth(text, filename)
        nodes = list(yaml.compose_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        what = " ".join(str(x) for x in (exc.context, exc.problem) if x)
        raise _fail(filename, line, f"(document): YAML syntax error: {what}; fix the YAML at this line") from None
    except yaml.YAMLError as exc:
        raise _fail(filename, 1, f"(document): YAML error: {str(exc).splitlines()[0]}; fix the file") from None
    except RecursionError:
        raise _fail(filename, 1, "(document): nested too deeply to read; a job is a few levels deep") from None
    if len(nodes) > 1:
        raise _fail(filename, nodes[1].start_mark.line + 1, "(document): more than one YAML document (---); "
                    "keep one job per file")
    if not nodes or (isinstance(nodes[0], yaml.ScalarNode) and nodes[0].tag == "tag:yaml.org,2002:null"):
        raise _fail(filename, 1, "(document): the file is empty; write a job mapping (see examples/quickstart.yaml)")
    data = _Builder(source).build(nodes[0], ())
    if not isinstance(data, dict):
        raise _fail(filename, nodes[0].start_mark.line + 1, f"(document): a job must be a mapping of sections "
                    f"(got {type(data).__name__}); start with `name:` and `model:`")
    return data, source


def parse_value(text: str, source: Source, label: str, path: Path = ()) -> Any:
    """One override's value (`--set k=VALUE`) under the file's limits: depth, tags, duplicate keys and the
    job's total value count (an alias bomb given through --set is refused like one in the file).

    Text that is not YAML is taken as the literal string; validation decides whether it fits.
    """
    try:
        _check_depth(text, source.filename, label)
        node = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError:
        return text
    except RecursionError:
        raise ConfigError(f"{label}: (override): nested too deeply to read; a job is a few levels deep") from None
    if node is None:
        return ""
    return _Builder(source, label).build(node, path)


def read_yaml_file(path: str) -> tuple[Any, Source]:
    """Read and parse a job file, with one-line errors for unreadable files (a FIFO or a device too)."""
    from hpctrain.userfiles import read_regular_file

    raw = read_regular_file(path, MAX_FILE_BYTES, f"{path}:0: (file)", larger="return")
    if len(raw) > MAX_FILE_BYTES:
        raise _fail(path, 1, f"(document): file is larger than {MAX_FILE_BYTES} bytes; a job file is a short "
                    "YAML mapping")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _fail(path, line, "(document): not UTF-8 text; save the file as UTF-8") from None
    return parse_yaml(text, path)
