"""Signals, the collective stop, time-limit safety and the requeue request (hpctrain/runtime/requeue.py, issue 7).

The Slurm end of the protocol (the batch script requeueing, preemption, arrays) runs on the real
local Slurm in tests/chaos/; here: the pure functions, the controller in one process with stub
`scontrol` / `squeue` programs on PATH, and one multi-rank run where a single rank gets the signal.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpctrain.config.infra import RestartConfig
from hpctrain.rundir.restart import Markers, decide
from hpctrain.runtime import requeue
from hpctrain.runtime.requeue import (
    RequeueController,
    SignalFlag,
    default_margin_s,
    end_time_from_env,
    parse_end_time,
    requeue_target,
    time_needed_s,
)

from ._dist import run_distributed
from ._entry import events, make_job, metrics, write_job

NOW = 1_700_000_000.0


@pytest.mark.parametrize(("environ", "want"), [
    ({}, None),
    ({"SLURM_JOB_ID": "42"}, "42"),
    ({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "1"}, "40_1"),  # the task, not 43 or 40
    ({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40"}, "43"),
])
def test_requeue_target(environ: dict[str, str], want: str | None) -> None:
    assert requeue_target(environ) == want


@pytest.mark.parametrize(("text", "want"), [
    ("2023-11-14T22:13:20\n", datetime.datetime(2023, 11, 14, 22, 13, 20).timestamp()),
    ("N/A\n", None), ("Unknown", None), ("", None), ("NONE", None),
])
def test_parse_end_time(text: str, want: float | None) -> None:
    assert parse_end_time(text) == want


@pytest.mark.parametrize(("environ", "limit", "want"), [
    ({"SLURM_JOB_END_TIME": "1700000600"}, "00:30:00", (1700000600.0, "SLURM_JOB_END_TIME")),
    ({"SLURM_JOB_START_TIME": "1699999000"}, "00:30:00", (1699999000.0 + 1800, "SLURM_JOB_START_TIME + slurm.time")),
    ({}, "90", (NOW + 5400, "process start + slurm.time")),
    ({}, "1-00:00:00", (NOW + 86400, "process start + slurm.time")),
    ({}, None, (None, "none")),
])
def test_end_time_from_env(environ: dict[str, str], limit: str | None, want: tuple[Any, str]) -> None:
    assert end_time_from_env(environ, limit, NOW) == want


@pytest.mark.parametrize(("save_s", "step_s", "margin_s", "want"), [
    (None, None, 60.0, 60.0), (10.0, 5.0, 60.0, 60.0), (40.0, 5.0, 60.0, 85.0), (40.0, None, 30.0, 80.0),
])
def test_time_needed(save_s: float | None, step_s: float | None, margin_s: float, want: float) -> None:
    assert time_needed_s(save_s, step_s, margin_s) == want


def test_margin_and_budget() -> None:
    assert (default_margin_s(None), default_margin_s("04:00:00"), default_margin_s("5")) == (60.0, 60.0, 30.0)
    # the runtime's budget check is the restart policy's (rundir/restart.py; tests/rundir/test_restart.py)
    asked = Markers(requeue_requested="signal USR2 at step 5")
    assert decide(0, asked, 5, None, 0, RestartConfig(max_requeues=3)).reason == "runtime-requested"
    assert decide(0, asked, 5, None, 3, RestartConfig(max_requeues=3)).reason == "max-requeues-reached"
    assert decide(0, asked, 5, None, 0, RestartConfig(max_requeues=3, requeue=False)).reason == "requeue-disabled"


# -- the controller in one process ----------------------------------------------------------------------
def _controller(environ: dict[str, str], attempt: int = 0, max_requeues: int = 3, time_limit: str | None = None,
                clock: Any = time.time) -> tuple[RequeueController, list[tuple[str, dict[str, Any]]], SignalFlag]:
    job = SimpleNamespace(slurm=SimpleNamespace(time=time_limit),
                          restart=RestartConfig(signal="USR2", max_requeues=max_requeues, requeue=True))
    seen: list[tuple[str, dict[str, Any]]] = []
    flag = SignalFlag()
    ctl = RequeueController(job, SimpleNamespace(rank=0, attempt=attempt), "cpu",
                            lambda name, **fields: seen.append((name, fields)), flag=flag, environ=environ,
                            clock=clock)
    return ctl, seen, flag


def _stub(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{body}\n")
    (folder / name).chmod(0o755)


def test_signal_stops_and_direct_requeue_calls_scontrol_on_the_array_task(tmp_path, monkeypatch, capsys) -> None:
    """Outside the rendered script (HPCTRAIN_REQUEUE_BY unset) rank 0 runs `scontrol requeue ARRAYJOB_TASK`."""
    calls = tmp_path / "calls"
    _stub(tmp_path / "bin", "scontrol", f'echo "$@" >> {calls}')
    _stub(tmp_path / "bin", "squeue", "echo N/A")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    ctl, seen, flag = _controller({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "1"})
    assert not ctl.should_stop(1)
    flag.handler(signal.SIGUSR2, None)  # what the installed handler does: set the flag, nothing more
    assert ctl.should_stop(2) and ctl.should_stop(2)  # decided once, stays decided
    assert ctl.finish(2, saved=True) == "requeued"
    assert calls.read_text() == "requeue 40_1\n"
    assert [name for name, _ in seen] == ["signal", "requeued"]
    assert seen[0][1]["signal"] == "USR2" and seen[1][1]["reason"] == "signal USR2 at step 2"
    assert "requeued job 40_1 after saving step 2" in capsys.readouterr().out


def test_direct_requeue_never_fails_silently(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here, as inside many containers
    ctl, seen, flag = _controller({"SLURM_JOB_ID": "7"})
    flag.handler(signal.SIGTERM, None)
    assert ctl.should_stop(5) and ctl.finish(5, saved=True) == "not-requeued"
    assert "NOT requeued: `scontrol` is not on PATH" in capsys.readouterr().err
    assert seen[-1] == ("not_requeued", {"reason": "signal TERM at step 5", "why_not": "scontrol-missing",
                                         "step": 5, "job_id": "7"})

    ctl, seen, flag = _controller({"SLURM_JOB_ID": "7"}, attempt=3, max_requeues=3)  # budget used up
    flag.handler(signal.SIGUSR2, None)
    assert ctl.should_stop(9) and ctl.finish(9, saved=True) == "not-requeued"
    assert seen[-1][1]["why_not"] == "max-requeues-reached" and "restart.max_requeues=3" in capsys.readouterr().err

    ctl, seen, flag = _controller({})  # not under Slurm at all: say how to continue
    flag.handler(signal.SIGTERM, None)
    assert ctl.should_stop(1) and ctl.finish(1, saved=True) == "not-requeued"
    assert "hpctrain resume" in capsys.readouterr().err and seen[-1][1]["why_not"] == "not-under-slurm"


def test_batch_script_mode_writes_the_marker_and_never_calls_scontrol(tmp_path, monkeypatch) -> None:
    calls = tmp_path / "calls"
    _stub(tmp_path / "bin", "scontrol", f'echo "$@" >> {calls}')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    marker = tmp_path / "task" / "requeue-requested"
    ctl, seen, flag = _controller({"SLURM_JOB_ID": "8", "SLURM_JOB_END_TIME": str(int(time.time()) + 3600),
                                   "HPCTRAIN_REQUEUE_BY": "batch-script", "HPCTRAIN_REQUEUE_MARKER": str(marker)})
    flag.handler(signal.SIGUSR2, None)
    assert ctl.should_stop(4) and ctl.finish(4, saved=True) == "marker"
    assert marker.read_text() == "signal USR2 at step 4\n" and not calls.exists()
    assert seen[-1][0] == "requeue requested" and seen[-1][1]["by"] == "batch-script"


def test_time_limit_safety_stops_before_a_late_signal(tmp_path, monkeypatch) -> None:
    now = [float(int(time.time()))]
    ctl, seen, _ = _controller({"SLURM_JOB_ID": "9", "SLURM_JOB_END_TIME": str(int(now[0]) + 200)},
                               clock=lambda: now[0])
    assert ctl.end_source == "SLURM_JOB_END_TIME"
    assert not ctl.should_stop(1, save_s=40.0)  # 200 s left > max(2 x 40 s + one step, 60 s)
    now[0] += 110  # 90 s left: still enough
    assert not ctl.should_stop(2, save_s=40.0)
    now[0] += 20  # 70 s left < 2 x 40 s + one step: stop now, whatever the signal does
    assert ctl.should_stop(3, save_s=40.0)
    assert seen[-1][0] == "time limit near" and "70 s left" in seen[-1][1]["reason"]
    assert "< 80 s needed" in seen[-1][1]["reason"]

    # squeue is asked when Slurm's environment does not say; asked again after END_TIME_REFRESH_S
    # (an admin may have moved the limit with `scontrol update`).
    answer = tmp_path / "end"
    answer.write_text(datetime.datetime.fromtimestamp(now[0] + 3600).isoformat(timespec="seconds"))
    _stub(tmp_path / "bin", "squeue", f"cat {answer}")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    ctl, seen, _ = _controller({"SLURM_JOB_ID": "9"}, time_limit="02:00:00", clock=lambda: now[0])
    assert ctl.end_source == "squeue" and not ctl.should_stop(1)
    answer.write_text(datetime.datetime.fromtimestamp(now[0] + 400).isoformat(timespec="seconds"))
    now[0] += 100
    assert not ctl.should_stop(2)  # not asked again yet: still 3500 s left as far as it knows
    now[0] += requeue.END_TIME_REFRESH_S
    assert ctl.should_stop(3) and "end time from squeue" in seen[-1][1]["reason"]


# -- several ranks: one signal stops all of them at the same step ------------------------------------------
def _signal_one_rank(argv: list[str], run_dir: str, victim: int, at_step: int) -> int:
    """The entry point; rank `victim` sends itself SIGUSR2 once `at_step` is logged (as srun would)."""
    from hpctrain.runtime.__main__ import main

    if int(os.environ["RANK"]) == victim:
        def fire() -> None:
            path = os.path.join(run_dir, "metrics.jsonl")
            while True:
                try:
                    with open(path) as handle:
                        if any(json.loads(line)["step"] >= at_step for line in handle):
                            os.kill(os.getpid(), signal.SIGUSR2)
                            return
                except (OSError, ValueError):  # not there yet, or a line half written
                    pass
                time.sleep(0.02)
        threading.Thread(target=fire, daemon=True).start()
    return main(argv)


@pytest.mark.dist
def test_one_rank_signalled_all_ranks_save_the_same_step_and_exit_0(tmp_path) -> None:
    job = make_job(dp=2, train={"steps": 40, "micro_batch": 1}, checkpoint={"every_steps": 100})
    run = str(tmp_path / "run")
    marker = tmp_path / "run" / "requeue-requested"
    argv = ["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", run]
    env = {"HPCTRAIN_REQUEUE_BY": "batch-script", "HPCTRAIN_REQUEUE_MARKER": str(marker),
           "HPCTRAIN_TEST_STEP_DELAY_S": "0.05"}
    codes = run_distributed(_signal_one_rank, 2, argv, run, 1, 3, init_process_group=False, env=env, timeout_s=120)
    assert codes == [0, 0]
    found = events(run)
    stop = [e for e in found if e["event"] == "signal"]
    assert len(stop) == 1 and stop[0]["signal"] == "USR2"
    step = stop[0]["step"]
    assert 3 <= step < 40 and [m["step"] for m in metrics(run)] == list(range(1, step + 1))
    saved = [e for e in found if e["event"] == "checkpoint saved"]
    assert [e["step"] for e in saved] == [step] and saved[0]["duration_s"] > 0
    assert marker.read_text() == f"signal USR2 at step {step}\n"
    assert [e["event"] for e in found][-2:] == ["requeue requested", "stopped"]
    assert os.path.isdir(os.path.join(run, "checkpoints", f"step-{step}"))


@pytest.mark.dist
def test_a_stop_that_cannot_be_requeued_exits_1(tmp_path) -> None:
    """Requeue budget spent: the ranks still save, but the job must not end COMPLETED (exit 1 on rank 0)."""
    job = make_job(train={"steps": 40, "micro_batch": 1}, checkpoint={"every_steps": 100},
                   slurm={"max_requeues": 1})
    run = str(tmp_path / "run")
    argv = ["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", run]
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "HPCTRAIN_TEST_STEP_DELAY_S": "0.05"}
    codes = run_distributed(_signal_one_rank, 1, argv, run, 0, 2, init_process_group=False, env=env, timeout_s=120)
    assert codes == [1]
    found = events(run)
    refused = [e for e in found if e["event"] == "not_requeued"]
    assert len(refused) == 1 and refused[0]["why_not"] != "not-under-slurm"
    step = refused[0]["step"]
    assert os.path.isdir(os.path.join(run, "checkpoints", f"step-{step}"))  # saved all the same
