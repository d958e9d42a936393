"""The run-directory contract is login-path code: no torch; and diagnose reads run directories without
importing the launch stage (docs/architecture.md: who imports whom)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import importlib, pkgutil, sys
import hpctrain.rundir, hpctrain.diagnose
for package in (hpctrain.rundir, hpctrain.diagnose):
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if info.name != "hpctrain.diagnose.plots":  # matplotlib, an extra
            importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "hpctrain.launch", "hpctrain.runtime"))))
"""


def test_rundir_and_diagnose_import_neither_torch_nor_launch() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
