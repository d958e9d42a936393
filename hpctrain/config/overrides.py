"""`--set a.b.c=VALUE` overrides: values are YAML scalars, applied before validation."""

from __future__ import annotations

import re
from typing import Any

from hpctrain.config.yaml_source import Path, Source, parse_value
from hpctrain.errors import ConfigError

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$")


def parse_override(text: str, source: Source | None = None) -> tuple[Path, Any]:
    """Split `a.b=value` into the path and the YAML-parsed value.

    The value is built under the same limits as the file (yaml_source.parse_value); with `source`,
    it counts towards that job's total number of values.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise ConfigError(f"--set {text}: (override): expected KEY=VALUE with a dotted key (got {text!r}); "
                          "e.g. --set parallel.tp=4")
    if len(raw) > 10_000:
        raise ConfigError(f"--set {text[:60]}...: (override): value longer than 10000 characters; put it in "
                          "the job file")
    label = f"--set {text if len(text) <= 80 else text[:77] + '...'}"
    path = tuple(key.split("."))
    value = parse_value(raw, source if source is not None else Source("--set"), label, path) if raw.strip() else ""
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str], source: Source) -> dict[str, Any]:
    """Set each override into data (creating mappings on the way) and record its origin in source."""
    for text in overrides:
        path, value = parse_override(text, source)
        node: Any = data
        for depth, part in enumerate(path[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise ConfigError(f"--set {text}: {where}: is not a section (got {child!r}); set a key that "
                                  "exists in the schema (`hpctrain schema`)")
            node = child
        if not isinstance(node, dict):  # pragma: no cover - guarded above
            raise ConfigError(f"--set {text}: cannot set here")
        node[path[-1]] = value
        source.overrides[path] = text
    return data
