"""A recipe rendered from a checkout builds its hpctrain from that checkout, with no package index.

The build is replayed without apptainer: the files the recipe's %files copies are copied into a scratch
image root, and what its %post pip-installs is installed, from there, non-editable into a fresh venv with
a build environment of its own (no system site packages: what this machine has installed by hand cannot
stand in for a missing install step); then hpctrain is imported from that venv.
"""

from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from venvs import clean_env, fresh_venv, pip_install

from hpctrain import __version__
from hpctrain.config import job_from_dict
from hpctrain.render import render_recipe
from hpctrain.render.recipe import source_checkout

from .hostile import BASE_JOB

spython_parsers = pytest.importorskip("spython.main.parse.parsers")


def _pip_arguments(post_lines: list[str]) -> list[str]:
    """The arguments after `--` of the one `python3 -m pip install` line of %post."""
    [line] = [line for line in post_lines if line.strip().startswith("python3 -m pip install")]
    words = shlex.split(line)
    return words[words.index("--") + 1:]


def _in_root(root: Path, image_path: str) -> Path:
    return root / image_path.lstrip("/")


def test_recipe_installs_hpctrain_from_the_checkout(tmp_path: Path) -> None:
    checkout = source_checkout()
    assert checkout is not None, "the tests run from a checkout"
    data = copy.deepcopy(BASE_JOB)
    data["container"] = {"recipe": {}}
    recipe = tmp_path / "recipe.def"
    recipe.write_text(render_recipe(job_from_dict(data)))
    parsed = spython_parsers.SingularityParser(str(recipe)).recipe["spython-base"]

    root = tmp_path / "image"  # what %files puts in the image
    assert parsed.files, "the recipe copies nothing"
    for line in parsed.files:  # "SOURCE DESTINATION", split on whitespace as apptainer does
        source, destination = line.split()
        assert Path(source).is_relative_to(checkout), source
        target = _in_root(root, destination)
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(source).is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    arguments = _pip_arguments(parsed.install)
    assert arguments == ["/opt/hpctrain-src"]  # hpctrain only: the job asks for no extra pip package

    # %post's `pip install` builds the copied checkout non-editable. Replayed in a fresh venv with a build
    # environment of its own (tests/venvs.py): nothing comes from this interpreter's site-packages.
    venv = tmp_path / "venv"
    python_path = fresh_venv(venv)
    pip_install(python_path, *(str(_in_root(root, a)) for a in arguments), options=("--no-build-isolation",))
    env = clean_env()
    python = str(python_path)

    probe = ("import hpctrain, hpctrain.render.recipe as r; from hpctrain.resources import data_dir; "
             "print(hpctrain.__file__); print(hpctrain.__version__); print(r.__file__); "
             "print((data_dir('sbatch_templates') / 'job.sbatch.j2').is_file())")
    result = subprocess.run([python, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    package_file, version, recipe_module, templates = result.stdout.split()
    assert Path(package_file).is_relative_to(venv), package_file  # the venv's copy, not the checkout itself
    assert (version, templates) == (__version__, "True")
    assert Path(recipe_module).read_text() == (checkout / "hpctrain" / "render" / "recipe.py").read_text()


def test_override_installs_the_requirement_and_copies_nothing(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE_JOB)
    data["container"] = {"recipe": {"hpctrain": "hpctrain @ git+https://example.org/hpctrain.git@v0.1.0"}}
    recipe = tmp_path / "recipe.def"
    recipe.write_text(render_recipe(job_from_dict(data)))
    parsed = spython_parsers.SingularityParser(str(recipe)).recipe["spython-base"]
    assert not parsed.files and "%files" not in recipe.read_text()
    assert _pip_arguments(parsed.install) == ["hpctrain @ git+https://example.org/hpctrain.git@v0.1.0"]
