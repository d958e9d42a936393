"""Monitors end with the job, children included: after the script exits, no monitor process is left
(the py-spy timer's pending `sleep` and the nvidia-smi loop included).

The stubs (stubs.py) run the monitors for real; here `sleep` and `nvidia-smi` also stay alive like the
real ones (a 3540 s timer, an endless sampling loop) and leave their pids behind.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import pytest

from hpctrain.config import job_from_dict
from hpctrain.render import render_script

from .hostile import BASE_JOB
from .stubs import make_stub_dir, run_script

LONG_LIVED = '''#!/bin/bash
printf '%s\\0' "${0##*/}" "$@" > "$STUB_LOG/calls/${EPOCHREALTIME/./}-$$-${0##*/}"
echo "$$" > "$STUB_LOG/pid-${0##*/}-$$"
exec /usr/bin/sleep 300
'''


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    folder = make_stub_dir(tmp_path / "stubs")
    for name in ("sleep", "nvidia-smi"):
        (folder / name).write_text(LONG_LIVED)
    return folder


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_monitors_and_their_children_end_with_the_script(tmp_path: Path, bin_dir: Path) -> None:
    data = copy.deepcopy(BASE_JOB)
    data["slurm"]["setup"] = []
    data["monitor"] = {"nvidia_smi": True, "py_spy": True, "py_spy_seconds_before_limit": 60}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = render_script(job_from_dict(data), run_dir=str(run_dir))
    started = time.monotonic()
    run = run_script(script, bin_dir=bin_dir, work=tmp_path, env={"STUB_WAIT_FOR": "sleep nvidia-smi"})
    pids = [int(p.read_text()) for p in run.log.glob("pid-*")]
    try:
        assert run.returncode == 0, run.stderr.decode(errors="replace")[-2000:]
        assert time.monotonic() - started < 20  # the script did not wait out a monitor
        assert sorted(p.name.split("-")[1] for p in run.log.glob("pid-*")) == ["nvidia", "sleep"]
        assert run.argv_of("sleep") == [["3540"]]  # the py-spy timer: 1 h limit - 60 s
        survivors = [pid for pid in pids if _alive(pid)]
        assert survivors == [], f"monitor processes alive after the script exited: {survivors}"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
