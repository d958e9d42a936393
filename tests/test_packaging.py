"""The wheel carries the templates, the recipe and the examples, and the console script."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_ships_templates_examples_and_typing_marker(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("hpctrain-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("hpctrain/py.typed", "hpctrain/sbatch_templates/job.sbatch.j2",
                     "hpctrain/singularity/recipe.def.j2", "hpctrain/examples/quickstart.yaml",
                     "hpctrain/examples/gpt3-175b.yaml", "hpctrain/examples/llama3-8b-sweep.yaml"):
        assert expected in names, expected
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "hpctrain = hpctrain.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
