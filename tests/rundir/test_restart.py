"""The restart policy (hpctrain/rundir/restart.py), table-driven: one row per rule, then its command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from hpctrain.config.infra import RestartConfig
from hpctrain.rundir.events import WHY_NOT_REQUEUED
from hpctrain.rundir.restart import NO_STEP, FailedStep, Markers, decide, exit_code_after

ON = RestartConfig(requeue=True, max_requeues=3)
OFF = RestartConfig(requeue=False, max_requeues=3)
ASKED = Markers(requeue_requested="signal USR2 at step 7: checkpoint saved")
BAD = Markers(bad_input="rank 3: train.data: no such file")
NONE = Markers()

# (id, exit code, markers, step, last failed step, attempt, policy, requeue, reason, cause, job's exit code)
CASES: list[tuple[str, int, Markers, Optional[int], Optional[FailedStep], int, RestartConfig, bool, str, str, int]] = [
    ("bad input: exit 2", 2, NONE, 5, None, 0, ON, False, "bad-input", "bad-input", 2),
    ("bad input: a rank's marker, srun killed the rest", 137, BAD, 5, None, 0, ON, False, "bad-input", "bad-input", 2),
    ("bad input beats a restart request", 0, Markers(ASKED.requeue_requested, BAD.bad_input), 5, None, 0, ON,
     False, "bad-input", "bad-input", 2),
    ("same step crashed twice", 1, NONE, 35, 35, 1, ON, False, "same-step", "rank-crashed", 1),
    ("same 'no step' crashed twice", 1, NONE, None, NO_STEP, 1, ON, False, "same-step", "rank-crashed", 1),
    ("a crash further on is progress", 1, NONE, 40, 35, 1, ON, True, "rank-crashed", "rank-crashed", 1),
    ("a first attempt's failed-step file is not a repeat", 1, NONE, 35, 35, 0, ON, True, "rank-crashed",
     "rank-crashed", 1),
    ("requeue disabled, crash", 4, NONE, 5, None, 0, OFF, False, "requeue-disabled", "rank-crashed", 4),
    ("requeue disabled, signal", 0, ASKED, 7, None, 0, OFF, False, "requeue-disabled", "runtime-requested", 1),
    ("max requeues used, crash", 3, NONE, 5, None, 3, ON, False, "max-requeues-reached", "rank-crashed", 3),
    ("max requeues used, signal", 0, ASKED, 7, None, 3, ON, False, "max-requeues-reached", "runtime-requested", 1),
    ("signal / preemption marker", 0, ASKED, 7, None, 1, ON, True, "runtime-requested", "runtime-requested", 1),
    ("marker with a non-zero exit", 143, ASKED, 7, 7, 1, ON, True, "runtime-requested", "runtime-requested", 143),
    ("plain crash, first time", 3, NONE, 5, None, 0, ON, True, "rank-crashed", "rank-crashed", 3),
    ("success", 0, NONE, 100, None, 0, ON, False, "finished", "finished", 0),
    ("success, requeue disabled", 0, NONE, 100, None, 2, OFF, False, "finished", "finished", 0),
]


@pytest.mark.parametrize(("exit_code", "markers", "step", "last_failed", "attempt", "policy", "requeue", "reason",
                          "cause", "job_exit"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(exit_code: int, markers: Markers, step: Optional[int], last_failed: Optional[FailedStep],
                attempt: int, policy: RestartConfig, requeue: bool, reason: str, cause: str, job_exit: int) -> None:
    decision = decide(exit_code, markers, step, last_failed, attempt, policy)
    assert (decision.requeue, decision.reason, decision.cause) == (requeue, reason, cause)
    assert decision.requeue or reason == "finished" or decision.why_not in WHY_NOT_REQUEUED
    assert exit_code_after(decision, exit_code) == job_exit


def _cli(run_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    answer = run_dir / "answer"
    out = subprocess.run([sys.executable, "-m", "hpctrain.rundir.restart", f"--run-dir={run_dir}", *args,
                          "--requeue=true", "--max-requeues=3", "--job-id=42", f"--answer={answer}",
                          f"--requeue-marker={run_dir / 'requeue-requested'}",
                          f"--bad-input-marker={run_dir / 'bad-input'}"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out, answer.read_text()


def test_command_line_answers_and_remembers_the_crash_step(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step":30}\n{"step":35}\n')
    out, answer = _cli(tmp_path, "--exit-code=3", "--attempt=0")
    assert answer == "requeue rank-crashed - 35 3\n"
    assert "srun exited with status 3" in out.stdout and "requeueing 42 (restart 1 of at most 3)" in out.stdout
    assert (tmp_path / "failed-step").read_text() == "35\n"
    out, answer = _cli(tmp_path, "--exit-code=3", "--attempt=1")
    assert answer == "stop rank-crashed same-step 35 3\n"
    assert "not requeued: failed again at step 35 after a requeue" in out.stderr


def test_command_line_without_metrics_or_markers(tmp_path: Path) -> None:
    out, answer = _cli(tmp_path, "--exit-code=0", "--attempt=0")
    assert answer == "done finished - null 0\n" and "training finished (attempt 0)" in out.stdout
    (tmp_path / "bad-input").write_text("rank 1: --job: no such file\n")
    out, answer = _cli(tmp_path, "--exit-code=137", "--attempt=0")
    assert answer == "stop bad-input bad-input null 2\n" and "rank 1: --job: no such file" in out.stderr
