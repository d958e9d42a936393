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


STATUS_PROBE = """
import json, sys
from pathlib import Path
from hpctrain.cli import main
run = Path(sys.argv[1]) / "demo-20260101-000000"
(run / "submit").mkdir(parents=True)
lines = [{"time": "2026-01-01T00:00:00.000+00:00", "event": "submitted", "executor": "local", "job_id": "local-1"},
         {"time": "2026-01-01T00:00:09.000+00:00", "event": "ended", "state": "COMPLETED", "executor": "local"}]
(run / "events.jsonl").write_text("".join(json.dumps(e) + "\\n" for e in lines))
(run / "job.resolved.yaml").write_text("name: demo\\ntrain:\\n  steps: 4\\n")
(run / "submit" / "local.json").write_text('{"state": "COMPLETED", "pid": 1}')
main(["status", "--runs-dir", sys.argv[1]])
print(sorted(m for m in sys.modules if m.split(".")[0] == "pydantic" or m == "hpctrain.config.job"))
"""


def test_status_of_local_runs_builds_no_schema(tmp_path: Path) -> None:
    """Listing runs reads their files; it needs neither pydantic nor the job schema (issue 23 item 8)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", STATUS_PROBE, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert "COMPLETED  -/4" in out.stdout and out.stdout.strip().splitlines()[-1] == "[]", out.stdout
