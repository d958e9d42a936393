"""Issue 18 item 6: every reader of a run directory goes through one error path.

A damaged file in a run directory (a byte that is not UTF-8, a field of the wrong type) must end each
command with hpctrain's one-line message and exit 2, never a traceback. Each case ran into a
traceback before hpctrain.rundir.read existed. The CLI runs as a subprocess, as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
JOB = {
    "name": "damaged",
    "model": {"preset": "tiny"},
    "train": {"global_batch": 8, "micro_batch": 1, "steps": 3, "precision": "fp32",
              "activation_checkpointing": "none", "log_every": 1},
    "parallel": {"tp": 1, "pp": 1, "dp": 1},
    "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 1, "gpu": "a100-80gb"},
}


def _run_dir(tmp_path: Path) -> Path:
    """A finished local run as launch and the runtime leave it (job files, events, local state, ranks)."""
    run = tmp_path / "runs" / "damaged-20260101-000000"
    for sub in ("submit", "logs", "ranks"):
        (run / sub).mkdir(parents=True)
    text = yaml.safe_dump(JOB, sort_keys=False)
    (run / "job.yaml").write_text(text)
    (run / "job.resolved.yaml").write_text(text)
    events = [{"time": "2026-01-01T00:00:00.000+00:00", "event": "submitted", "executor": "local", "job_id": "local-1"},
              {"time": "2026-01-01T00:00:01.000+00:00", "event": "started", "attempt": 0},
              {"time": "2026-01-01T00:00:09.000+00:00", "event": "finished", "attempt": 0, "step": 3}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "submit" / "local.json").write_text(json.dumps({"state": "COMPLETED", "pid": 1, "attempt": 0,
                                                           "exit_codes": [0], "reason": None}))
    (run / "ranks" / "rank-0.json").write_text(json.dumps({"rank": 0, "world_size": 1, "step_time_s": 0.1}))
    return run


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def _non_utf8_events(run: Path) -> str:
    lines = (run / "events.jsonl").read_bytes().splitlines(keepends=True)
    (run / "events.jsonl").write_bytes(lines[0] + b'{"event": "started", "host": "n\xff1"}\n' + lines[2])
    return "events.jsonl: line 2, byte 0xff at offset"


def _non_utf8_resolved(run: Path) -> str:
    (run / "job.resolved.yaml").write_bytes((run / "job.resolved.yaml").read_bytes() + b"# caf\xe9\n")
    return "job.resolved.yaml: byte 0xe9 at offset"


def _rank_of_wrong_type(run: Path) -> str:
    (run / "ranks" / "rank-0.json").write_text(json.dumps({"rank": "zero", "step_time_s": 0.1}))
    return "rank-0.json: field 'rank' is 'zero' (str), not int"


def _local_state_of_wrong_type(run: Path) -> str:
    (run / "submit" / "local.json").write_text(json.dumps({"state": 5, "pid": 1, "exit_codes": [0]}))
    return "local.json: field 'state' is 5 (int), not str"


def _sweep_of_wrong_type(run: Path) -> str:
    (run / "sweep.json").write_text(json.dumps({"job_id": "local-1", "tasks": [{"task_id": "zero", "run_dir": "tasks/0"}]}))
    return "sweep.json: field 'task_id' is 'zero' (str), not int"


CASES = [
    pytest.param(["status"], _non_utf8_events, id="status-events-not-utf8"),
    pytest.param(["resume"], _non_utf8_events, id="resume-events-not-utf8"),
    pytest.param(["doctor", "--no-scheduler"], _non_utf8_resolved, id="doctor-resolved-not-utf8"),
    pytest.param(["report", "--no-plots"], _non_utf8_resolved, id="report-resolved-not-utf8"),
    pytest.param(["doctor", "--no-scheduler"], _rank_of_wrong_type, id="doctor-rank-summary-wrong-type"),
    pytest.param(["report", "--no-plots"], _rank_of_wrong_type, id="report-rank-summary-wrong-type"),
    pytest.param(["status"], _local_state_of_wrong_type, id="status-local-state-wrong-type"),
    pytest.param(["doctor", "--no-scheduler"], _local_state_of_wrong_type, id="doctor-local-state-wrong-type"),
    pytest.param(["status"], _sweep_of_wrong_type, id="status-sweep-wrong-type"),
    pytest.param(["report", "--no-plots"], _sweep_of_wrong_type, id="report-sweep-wrong-type"),
]


@pytest.mark.parametrize(("command", "damage"), CASES)
def test_damaged_run_dir_is_one_line_exit_2(tmp_path: Path, command: list[str], damage) -> None:
    run = _run_dir(tmp_path)
    expected = damage(run)
    result = _cli([command[0], str(run), *command[1:]], cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert expected in lines[0] and "the run directory is damaged" in lines[0], lines[0]
