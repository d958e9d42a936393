"""Golden files: every example renders to the script and recipe recorded in tests/golden/.

On a mismatch the test shows the diff; after a deliberate change, regenerate them all with

    HPCTRAIN_REGEN_GOLDEN=1 python -m pytest tests/render/test_golden.py

and review `git diff tests/golden`. The planner's choices (placement, --switches) are part of the
resolved job, so a planner change shows up here too.
"""

from __future__ import annotations

import difflib
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import load_job
from hpctrain.render import render_recipe, render_script
from hpctrain.render.recipe import source_checkout
from hpctrain.render.vcjob import render_vcjob

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
REGEN = "HPCTRAIN_REGEN_GOLDEN=1 python -m pytest tests/render/test_golden.py"


@pytest.fixture(autouse=True)
def fixed_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host job's ranks run sys.executable (render.context.rank_python): the same path on every machine."""
    monkeypatch.setattr(sys, "executable", "/opt/hpctrain/venv/bin/python3")


def array_spec(job: Any) -> str | None:
    """The --array a sweep of this job gets: one task per grid point, max_parallel at once."""
    if job.sweep is None:
        return None
    points = math.prod(len(values) for values in job.sweep.grid.values())
    return f"0-{points - 1}%{job.sweep.max_parallel}"


def is_volcano(example: Path) -> bool:
    return load_job(str(example)).cluster.executor == "volcano"


def golden_names(example: Path) -> set[str]:
    """A volcano example has a Volcano Job manifest; every other one a script and a recipe."""
    if is_volcano(example):
        return {f"{example.stem}.vcjob.yaml"}
    return {f"{example.stem}.{ext}" for ext in ("sbatch", "def")}


def rendered(example: Path) -> dict[str, str]:
    job = load_job(str(example))
    if job.cluster.executor == "volcano":
        return {f"{example.stem}.vcjob.yaml": render_vcjob(job)}
    run_dir = f"/scratch/runs/{example.stem}"
    recipe = render_recipe(job)
    checkout = source_checkout()  # the recipe copies hpctrain from it: a different path on every machine
    if checkout is not None:
        recipe = recipe.replace(str(checkout), "/home/user/hpctrain")
    return {f"{example.stem}.sbatch": render_script(job, run_dir=run_dir, array=array_spec(job)),
            f"{example.stem}.def": recipe}


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HPCTRAIN_REGEN_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"no golden file {path.relative_to(REPO)}; create it with:\n  {REGEN}")
    recorded = path.read_text(encoding="utf-8")
    if recorded != text:
        diff = "".join(difflib.unified_diff(recorded.splitlines(True), text.splitlines(True),
                                            f"tests/golden/{name} (recorded)", f"{name} (rendered now)"))
        pytest.fail(f"{name} differs from its golden file:\n{diff}\nIf the change is intended, regenerate with:\n"
                    f"  {REGEN}", pytrace=False)


def test_every_example_has_golden_files() -> None:
    assert EXAMPLES, "no examples found"
    if os.environ.get("HPCTRAIN_REGEN_GOLDEN") != "1":
        expected = set().union(*(golden_names(e) for e in EXAMPLES))
        assert expected == {p.name for pattern in ("*.sbatch", "*.def", "*.vcjob.yaml") for p in GOLDEN.glob(pattern)}


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_example_matches_golden(example: Path) -> None:
    for name, text in rendered(example).items():
        check_golden(name, text)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_example_script_passes_bash_n_and_shellcheck(example: Path, tmp_path: Path) -> None:
    if is_volcano(example):
        pytest.skip("a volcano example has no script: its pod command is an argv list (tests/render/test_vcjob.py)")
    name = f"{example.stem}.sbatch"
    path = tmp_path / name
    path.write_text(rendered(example)[name])
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr
    lint = subprocess.run(["shellcheck", "--severity=style", str(path)], capture_output=True, text=True, check=False)
    assert lint.returncode == 0, lint.stdout
    # The recipe's %post is an sh script: it must parse and lint too.
    post = rendered(example)[f"{example.stem}.def"].split("\n%post\n", 1)[1].split("\n%", 1)[0]
    (tmp_path / "post.sh").write_text("#!/bin/sh\n" + post)
    lint = subprocess.run(["shellcheck", "--severity=style", str(tmp_path / "post.sh")], capture_output=True,
                          text=True, check=False)
    assert lint.returncode == 0, lint.stdout
