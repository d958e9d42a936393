"""Find the files that ship with hpctrain (templates, the recipe, examples) in a wheel or a checkout."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """The folder `name` ('sbatch_templates', 'singularity' or 'examples').

    Installed from a wheel it is the subpackage hpctrain/<name>; in a source checkout (editable
    install or PYTHONPATH) it is <repo>/<name>, mapped to that subpackage by pyproject.toml.
    """
    for candidate in (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    import importlib.resources

    return Path(str(importlib.resources.files(f"hpctrain.{name}")))
