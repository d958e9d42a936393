"""The Singularity/Apptainer recipe, parsed back with spython."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from hpctrain import __version__
from hpctrain.config import job_from_dict
from hpctrain.errors import RenderError
from hpctrain.render import render_recipe

from .hostile import BASE_JOB

spython_parsers = pytest.importorskip("spython.main.parse.parsers")


def _recipe(tmp_path: Path, parse: bool = True, **recipe: Any) -> Any:
    data = copy.deepcopy(BASE_JOB)
    data["container"] = {"recipe": recipe}
    path = tmp_path / "recipe.def"
    path.write_text(render_recipe(job_from_dict(data)))
    if not parse:  # spython parses docker bootstraps only
        return None, path.read_text()
    return spython_parsers.SingularityParser(str(path)).recipe["spython-base"], path.read_text()


def test_sections_parse_back(tmp_path: Path) -> None:
    parsed, text = _recipe(tmp_path, base_image="docker://nvcr.io/nvidia/pytorch:24.12-py3",
                           pip=["einops==0.8.0", "wandb"], apt=["libibverbs-dev", "curl=7.88.1-10"])
    assert text.startswith("Bootstrap: docker\nFrom: nvcr.io/nvidia/pytorch:24.12-py3\n")
    assert parsed.fromHeader == "nvcr.io/nvidia/pytorch:24.12-py3"
    assert f"org.hpctrain.version {__version__}" in parsed.labels
    assert "NCCL_DEBUG=${NCCL_DEBUG:-WARN}" in parsed.environ
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}" in parsed.environ
    install = "\n".join(parsed.install)
    # hpctrain from this checkout (tests run from one; test_recipe_checkout.py builds it)
    assert "python3 -m pip install --no-cache-dir -- /opt/hpctrain-src einops==0.8.0 wandb" in install
    assert "apt-get install -y --no-install-recommends libibverbs-dev curl=7.88.1-10" in install
    assert parsed.cmd == 'exec python3 -m hpctrain.runtime "$@"'
    assert parsed.test  # spython moves %test into a tests.sh it builds in install
    assert "import torch, hpctrain" in install and "torch.cuda.nccl.version()" in install and "CUDA" in install


@pytest.mark.parametrize(("base", "agent", "source"), [
    ("docker://nvcr.io/nvidia/pytorch:24.12-py3", "docker", "nvcr.io/nvidia/pytorch:24.12-py3"),
    ("nvcr.io/nvidia/pytorch:24.12-py3", "docker", "nvcr.io/nvidia/pytorch:24.12-py3"),
    ("library://sylabs/examples/pytorch:latest", "library", "sylabs/examples/pytorch:latest"),
    ("oras://ghcr.io/org/img:1", "oras", "ghcr.io/org/img:1"),
    ("/images/base.sif", "localimage", "/images/base.sif"),
])
def test_bootstrap_agent_from_the_base_image(tmp_path: Path, base: str, agent: str, source: str) -> None:
    _, text = _recipe(tmp_path, parse=False, base_image=base)
    assert text.startswith(f"Bootstrap: {agent}\nFrom: {source}\n")


@pytest.mark.parametrize("base", ["docker://x y", "docker://x\nBootstrap: shub", "$(pwned)", "docker://a;b"])
def test_header_values_are_validated(tmp_path: Path, base: str) -> None:
    with pytest.raises(RenderError, match="container.recipe.base_image: not an image reference"):
        _recipe(tmp_path, base_image=base)


@pytest.mark.parametrize("package", ["-o APT::x=1", "curl; pwned", "Foo", "a b"])
def test_apt_names_are_validated(tmp_path: Path, package: str) -> None:
    with pytest.raises(RenderError, match="container.recipe.apt: not a Debian package name"):
        _recipe(tmp_path, apt=[package])
