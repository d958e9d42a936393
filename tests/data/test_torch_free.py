"""`hpctrain data` runs on a login node: hpctrain.data imports neither torch nor the runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import importlib, pkgutil, sys
import hpctrain.data
for info in pkgutil.iter_modules(hpctrain.data.__path__, "hpctrain.data."):
    importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "hpctrain.runtime", "hpctrain.export"))))
"""


def test_data_preparation_imports_neither_torch_nor_the_runtime() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
