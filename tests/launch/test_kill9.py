"""Issue 30 acceptance: the 16-trial kill -9 schedule and the 6 layout-change resumes on the local executor,
as `python bench/kill9.py --check` runs them (each kill then `hpctrain resume`; every step once, the
uninterrupted run's losses, grad norms, validation losses and final checkpoint tensors bit for bit; each
resume onto another layout within 1e-5). The trials and checks are described in bench/kill9.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.dist]


@pytest.mark.timeout(900)
def test_kill9_schedule_and_layout_resumes(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the bench's tracker is TensorBoard (pip install 'hpctrain[tensorboard]')")
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCTRAIN_"))}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "kill9.py"), "--check", "--work", str(tmp_path / "w"),
                             "--json", str(tmp_path / "kill9.json")], env=env, capture_output=True, text=True,
                            timeout=840)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    report = json.loads((tmp_path / "kill9.json").read_text())
    assert report["failures"] == []
    kills = report["kills"]
    assert len(kills) == 16 and {t["moment"] for t in kills} == {"save", "finalize", "eval", "tracker"}
    assert all(t["killed"] >= 1 for t in kills), kills
    assert [t["to"] for t in report["layouts"]] == ["dp2", "tp2", "dp2", "pp2", "dp2", "1"]
    assert report["final_tensors_compared"] > 0
    print(f"bench/kill9.py --check: {time.monotonic() - started:.0f} s")
