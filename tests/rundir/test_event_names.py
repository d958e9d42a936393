"""Event names are constants of rundir/events.py (docs/architecture.md section 3): no writer or reader in
hpctrain/ names an event by a string literal of its own, and the batch script's exit path writes only
names that are constants there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from hpctrain.rundir import events

REPO = Path(__file__).resolve().parents[2]
WRITERS = {"append_event", "event", "emit", "_emit", "events_named"}
CONSTANT_NAMES = {value for key, value in vars(events).items() if key.isupper() and isinstance(value, str)}


def _literal_event_names(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in WRITERS:
                args = node.args if name == "events_named" else node.args[:2]
                found += [(node.lineno, a.value) for a in args
                          if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value in CONSTANT_NAMES]
        if isinstance(node, ast.Compare) and any(isinstance(o, ast.Constant) and o.value == "event" for o in
                                                 ast.walk(node.left)):
            for comparator in node.comparators:
                found += [(node.lineno, c.value) for c in ast.walk(comparator)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in CONSTANT_NAMES]
    return found


def test_no_module_names_an_event_by_a_literal() -> None:
    offenders = []
    for path in sorted((REPO / "hpctrain").rglob("*.py")):
        if path == REPO / "hpctrain" / "rundir" / "events.py":
            continue
        for line, name in _literal_event_names(ast.parse(path.read_text(encoding="utf-8"))):
            offenders.append(f"{path.relative_to(REPO)}:{line}: {name!r}")
    assert offenders == []


def test_the_check_finds_a_literal(tmp_path: Path) -> None:
    tree = ast.parse('append_event(run_dir, "finished", step=3)\nif e.get("event") in ("stopped", X):\n    pass\n')
    assert _literal_event_names(tree) == [(1, "finished"), (2, "stopped")]


def test_the_exit_path_writes_only_named_events() -> None:
    text = (REPO / "sbatch_templates" / "exit_path.sh.j2").read_text(encoding="utf-8")
    written = set(re.findall(r"log_event (\w+)", text))
    assert written and written <= CONSTANT_NAMES, written - CONSTANT_NAMES
