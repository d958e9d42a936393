"""The flat, validated context of the Singularity/Apptainer recipe."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain import __version__
from hpctrain.errors import RenderError
from hpctrain.render.nccl import COMMON
from hpctrain.render.quoting import comment_lines

if TYPE_CHECKING:
    from hpctrain.config import Job

# Bootstrap agents, by the base image's URI scheme (Apptainer "Definition files", header section).
_SCHEMES = {"docker://": "docker", "library://": "library", "oras://": "oras", "docker-daemon:": "docker-daemon"}
# A container reference or local image path that the header line (not a shell) can carry as is.
_REFERENCE = re.compile(r"[A-Za-z0-9._/:@+-]+")
# Debian package names (Debian Policy 5.6.1), optionally pinned with =VERSION.
_APT_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+:~-]+)?")


def bootstrap(base_image: str) -> tuple[str, str]:
    """(Bootstrap agent, From value) for container.recipe.base_image."""
    agent, source = "docker", base_image
    for prefix, name in _SCHEMES.items():
        if base_image.startswith(prefix):
            agent, source = name, base_image[len(prefix):]
            break
    else:
        if base_image.endswith(".sif") or base_image.startswith(("/", "./")):
            agent = "localimage"
    if not _REFERENCE.fullmatch(source):
        raise RenderError(f"container.recipe.base_image: not an image reference the recipe header can carry "
                          f"(got {base_image!r:.80}); use e.g. docker://nvcr.io/nvidia/pytorch:24.12-py3 "
                          "(letters, digits and . _ / : @ + -)")
    return agent, source


# The definition file is read line by line and a line starting with % opens a section, so a value
# spanning lines could open one (e.g. a %runscript of its own): no control characters anywhere.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


# What building hpctrain from its checkout needs (pyproject.toml names README.md and maps the template
# folders into the package; setup.py finds the packages); copied by %files, never the whole checkout
# (.git, runs/, caches).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "setup.cfg", "README.md", "hpctrain", "sbatch_templates", "singularity",
                "examples")
SOURCE_IN_IMAGE = "/opt/hpctrain-src"
# A %files line is split on whitespace by apptainer/singularity and has no quoting we can rely on.
_FILES_PATH = re.compile(r"[A-Za-z0-9._/+@-]+")


def source_checkout() -> Optional[Path]:
    """The source checkout this hpctrain runs from (editable install or PYTHONPATH), or None (a wheel)."""
    import hpctrain

    root = Path(hpctrain.__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"hpctrain"', pyproject.read_text(encoding="utf-8")):
        return root
    return None


def hpctrain_install(recipe: Any) -> tuple[list[tuple[str, str]], str, str]:
    """(%files pairs, the pip argument that installs hpctrain, why that one, for a comment).

    hpctrain is on no package index: the image gets the checkout hpctrain runs from, copied in by %files.
    container.recipe.hpctrain (a pip requirement: VCS URL, URL of a wheel...) overrides that.
    """
    if getattr(recipe, "hpctrain", None):
        return [], recipe.hpctrain, "container.recipe.hpctrain"
    root = source_checkout()
    if root is None:
        return [], f"hpctrain=={__version__}", ("no source checkout found (hpctrain runs from a wheel): set "
                                                "container.recipe.hpctrain to a requirement the image can reach")
    if not _FILES_PATH.fullmatch(str(root)):
        return [], f"hpctrain=={__version__}", (f"the checkout {str(root)!r:.80} has characters a %files line "
                                                "cannot carry: set container.recipe.hpctrain instead")
    files = [(str(root / name), f"{SOURCE_IN_IMAGE}/{name}") for name in BUILD_INPUTS if (root / name).exists()]
    return files, SOURCE_IN_IMAGE, f"the checkout it was rendered from, {root}"


def recipe_context(job: Job) -> dict[str, Any]:
    recipe = job.container.recipe
    for package in recipe.pip:
        if _CONTROL.search(package):
            raise RenderError(f"container.recipe.pip: a recipe line cannot carry control characters such as "
                              f"newlines (got {package!r:.80}); write one requirement per list item")
    for package in recipe.apt:
        if not _APT_PACKAGE.fullmatch(package):
            raise RenderError(f"container.recipe.apt: not a Debian package name (got {package!r:.80}); use e.g. "
                              "libibverbs-dev or curl=7.88.1-10")
    agent, source = bootstrap(recipe.base_image)
    files, requirement, origin = hpctrain_install(recipe)
    return {
        "version": __version__,
        "bootstrap": agent,
        "source": source,
        "apt": list(recipe.apt),
        "pip": list(recipe.pip),
        "hpctrain_files": files,
        "hpctrain_requirement": requirement,
        "hpctrain_origin": comment_lines(f"hpctrain from {origin}.", 96),
        "nccl_defaults": [{"name": v.name, "value": v.value, "why": comment_lines(f"{v.name}: {v.why}", 96)}
                          for v in COMMON if v.value is not None and not v.under_task_dir],
    }
