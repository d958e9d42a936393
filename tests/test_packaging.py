"""The wheel: built from a clean checkout in a build environment of its own, it carries every package, the
templates, the recipe and the examples; its base dependencies are the login path's; installed non-editable
into a fresh venv it validates, dry-runs and trains the quickstart from a folder outside the checkout."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
from venvs import REPO, build_wheel, clean_checkout, fresh_venv, pip_install, run

# What the login-path commands import (pyproject.toml's `dependencies`); torch and every heavy library
# are extras.
LOGIN_PATH_DEPENDENCIES = {"pydantic", "pyyaml", "jinja2", "submitit", "tabulate", "python-hostlist", "tqdm"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    python = fresh_venv(root / "build-env")
    source = clean_checkout(root / "src")
    (root / "dist").mkdir()
    return build_wheel(python, source, root / "dist")


def _metadata(wheel: Path) -> tuple[set[str], str, str]:
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    return names, metadata, entry_points


def test_wheel_ships_every_package_templates_examples_and_typing_marker(wheel: Path) -> None:
    names, _, entry_points = _metadata(wheel)
    packages = sorted(str(p.relative_to(REPO)) for p in (REPO / "hpctrain").rglob("__init__.py"))
    assert [p for p in packages if p not in names] == []  # a package left out (hpctrain/rundir once was)
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "hpctrain").rglob("*.py"))
    assert [m for m in modules if m not in names] == []
    for expected in ("hpctrain/py.typed", "hpctrain/sbatch_templates/job.sbatch.j2",
                     "hpctrain/singularity/recipe.def.j2", "hpctrain/examples/quickstart.yaml",
                     "hpctrain/examples/gpt3-175b.yaml", "hpctrain/examples/llama3-8b-sweep.yaml",
                     "hpctrain/examples/mixtral-8x7b.yaml",
                     "hpctrain/examples/nvidia-smi-topo.txt", "hpctrain/examples/topology.conf"):  # the tour's
        assert expected in names, expected
    assert "hpctrain = hpctrain.cli:main" in entry_points


def test_wheel_base_dependencies_are_the_login_path_set(wheel: Path) -> None:
    _, metadata, _ = _metadata(wheel)
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    base = {r.split(";")[0].split("<")[0].split(">")[0].split("=")[0].split("[")[0].strip().lower()
            for r in requires if "extra ==" not in r}
    assert base == LOGIN_PATH_DEPENDENCIES


@pytest.mark.slow
def test_installed_wheel_dry_runs_and_trains_the_quickstart_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "venv")
    pip_install(python, f"{wheel}[runtime]")
    hpctrain = str(python.parent / "hpctrain")
    work = tmp_path / "work"  # a folder outside the checkout
    work.mkdir()
    where = run([str(python), "-c", "import hpctrain, hpctrain.rundir; from hpctrain.resources import data_dir; "
                 "print(hpctrain.__file__); print(data_dir('examples'))"], cwd=work).stdout.split()
    assert Path(where[0]).is_relative_to(tmp_path / "venv"), where  # the installed copy, not the checkout
    shutil.copy(Path(where[1]) / "quickstart.yaml", work / "quickstart.yaml")
    shutil.copy(REPO / "README.md", work / "text.md")

    assert "valid (job 'quickstart'" in run([hpctrain, "validate", "quickstart.yaml"], cwd=work).stdout
    dry = run([hpctrain, "submit", "quickstart.yaml", "--dry-run"], cwd=work)
    assert "dry run: nothing submitted" in dry.stdout
    run([hpctrain, "data", "prepare", "text.md", "-o", "tokens.bin"], cwd=work)
    trained = run([hpctrain, "submit", "quickstart.yaml", "--set", "train.steps=4", "--set", "train.data=tokens.bin",
                   "--set", "train.lr_schedule.warmup_steps=1", "--set", "checkpoint.every_steps=4", "--wait", "--timeout", "300"], cwd=work, timeout_s=400)
    assert "COMPLETED at step 4" in trained.stdout, trained.stdout + trained.stderr
    [run_dir] = [p for p in (work / "runs").iterdir() if p.name.startswith("quickstart-") and
                 (p / "metrics.jsonl").exists()]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
