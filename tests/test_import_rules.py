"""The stage table (docs/architecture.md, "Who imports whom"), checked on every import statement in hpctrain/:
at module level, inside functions and under TYPE_CHECKING alike. Also: no two modules import each other
(TYPE_CHECKING-only imports aside), torch is imported only by the torch-side packages, and a process that
imports every login-path module has not loaded torch."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hpctrain"

# stage -> the stages it may import (None: any). Modules at the top of the package (errors.py, resources.py,
# userfiles.py, __init__.py) are shared by every stage and import no stage themselves.
ALLOWED: dict[str, set[str] | None] = {
    "cli": None,
    "config": set(),
    "plan": {"config"},
    "render": {"config", "plan", "rundir"},
    "launch": {"config", "plan", "render", "rundir"},
    "diagnose": {"config", "plan", "rundir"},
    "runtime": {"config", "plan", "rundir"},
    "rundir": {"config"},
    "data": {"config", "rundir"},
    "export": {"config", "plan", "rundir", "runtime"},
    "job": {"rundir"},  # hpctrain/job.py: the user's script's API (torch- and pydantic-free)
}
ENTRY = {"__main__"}  # `python -m hpctrain`: the command line's entry, part of cli
TORCH_SIDE = {"runtime", "export"}  # the only packages that may import torch (at any depth)
LOGIN_PATH = ("config", "plan", "render", "launch", "diagnose", "rundir", "data", "cli")
# Heavy optional extras a login-path module may load only when its command runs; they are not torch.
NOT_IMPORTED_FOR_THE_PROBE = {"hpctrain.diagnose.plots"}  # matplotlib (the plot extra)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage_of(module: str) -> str:
    """hpctrain.plan.memory -> plan; hpctrain.errors -> errors; hpctrain -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(root: Path) -> list[tuple[str, int, str, bool]]:
    """(importing module, line, imported name, only under TYPE_CHECKING) for every import in the package.

    `from a.b import c` names a.b.c when c is a module of the package, else a.b; relative imports are resolved.
    """
    modules = {module_name(p, root) for p in root.rglob("*.py")}
    out = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        typing_only = _type_checking_lines(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                targets = subs or [base]
            for target in targets:
                out.append((name, node.lineno, target, node.lineno in typing_only))
    return out


def violations(root: Path) -> list[str]:
    """Every import that breaks the stage table, the torch rule or the no-cycle rule, one line each."""
    found = []
    for module, line, target, _ in imports(root):
        where = f"{module} (line {line}) imports {target}"
        src = stage_of(module)
        if target == "torch" or target.startswith("torch."):
            if src not in TORCH_SIDE:
                found.append(f"{where}: only {sorted(TORCH_SIDE)} may import torch")
            continue
        if not target.startswith("hpctrain.") or src in ENTRY:
            continue
        dst = stage_of(target)
        if dst == src or dst not in ALLOWED:
            continue  # the same stage, or a shared top-level module
        if dst == "cli":
            found.append(f"{where}: nothing imports cli (it is the only place stages meet)")
        elif src not in ALLOWED:
            found.append(f"{where}: {src} is a shared module and may import no stage")
        elif ALLOWED[src] is not None and dst not in ALLOWED[src]:
            allowed = ", ".join(sorted(ALLOWED[src] or ())) or "no other stage"
            found.append(f"{where}: {src} may import {allowed}")
    edges: dict[str, set[str]] = defaultdict(set)
    for module, _, target, typing_only in imports(root):
        if not typing_only and target != module:
            edges[module].add(target)
    for a in sorted(edges):
        for b in sorted(edges[a]):
            if a < b and a in edges.get(b, ()):
                found.append(f"{a} and {b} import each other")
    return found


def test_every_import_in_hpctrain_follows_the_stage_table() -> None:
    assert violations(PACKAGE) == []


def test_the_stage_table_covers_every_package_of_hpctrain() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages <= set(ALLOWED), sorted(packages - set(ALLOWED))


@pytest.mark.parametrize(("stage_file", "planted", "expected"), [
    ("config/loader.py", "from hpctrain.cli import main", "nothing imports cli"),
    ("plan/memory.py", "from hpctrain.cli.options import add_set_option", "nothing imports cli"),
    ("rundir/layout.py", "import hpctrain.render.quoting", "rundir may import config"),
    ("render/quoting.py", "from hpctrain.runtime import trainer", "render may import config, plan, rundir"),
    ("diagnose/doctor.py", "from hpctrain.launch import status", "diagnose may import config, plan, rundir"),
    ("plan/cost.py", "import torch", "may import torch"),
])
def test_a_planted_import_inside_a_function_is_found(tmp_path: Path, stage_file: str, planted: str,
                                                     expected: str) -> None:
    copy = tmp_path / "hpctrain"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / stage_file
    target.write_text(target.read_text(encoding="utf-8") + f"\n\ndef _planted() -> None:\n    {planted}\n",
                      encoding="utf-8")
    found = sorted(set(violations(copy)) - set(violations(PACKAGE)))
    assert len(found) == 1 and expected in found[0] and stage_file.replace("/", ".")[:-3] in found[0], found


def test_two_modules_that_import_each_other_are_found(tmp_path: Path) -> None:
    copy = tmp_path / "hpctrain"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "plan" / "a_first.py").write_text("def f() -> None:\n    from hpctrain.plan import a_second\n")
    (copy / "plan" / "a_second.py").write_text("from hpctrain.plan import a_first\n")
    found = sorted(set(violations(copy)) - set(violations(PACKAGE)))
    assert found == ["hpctrain.plan.a_first and hpctrain.plan.a_second import each other"]


PROBE = """
import importlib, pkgutil, sys
import hpctrain
skip = set(sys.argv[2].split(","))
for stage in sys.argv[1].split(","):
    package = importlib.import_module("hpctrain." + stage)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name not in skip:
            importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_importing_every_login_path_module_loads_no_torch() -> None:
    stages = [s for s in LOGIN_PATH if (PACKAGE / s / "__init__.py").is_file()]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE, ",".join(stages), ",".join(NOT_IMPORTED_FOR_THE_PROBE)],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
