"""The pieces of following a run without a whole run (issue 29): `logs -f` moving on to a new attempt's log,
the progress lines' pace and content, and the checks of the follow options. Real files; a clock passed in."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.launch.follow import _Lines, progress_line
from hpctrain.launch.logs import follow_logs


def test_logs_follow_prints_what_is_appended_and_moves_on_to_the_next_attempt(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    first = logs / "rank-0.attempt-0.log"
    first.write_text("step 1\n")
    out, notes, ended = io.BytesIO(), [], threading.Event()
    follower = threading.Thread(target=follow_logs, args=(tmp_path, 0, None, out),
                                kwargs={"ended": ended.is_set, "note": notes.append, "poll_s": 0.02,
                                        "check_every_s": 0.02})
    follower.start()
    try:
        time.sleep(0.2)
        with open(first, "a") as handle:
            handle.write("step 2\nhalf a li")  # a line being written is held back until it is whole
            handle.flush()
            time.sleep(0.2)
            assert out.getvalue() == b"step 1\nstep 2\n"
            handle.write("ne\n")
            handle.write("last words")  # then, before the next poll, a restart begins the next attempt
        (logs / "rank-0.attempt-1.log").write_text("resumed at step 2\n")
        (logs / "rank-1.attempt-1.log").write_text("another rank\n")  # --rank 0: not shown
        time.sleep(0.2)
        with open(logs / "rank-0.attempt-1.log", "a") as handle:
            handle.write("step 3\nno newline at the end")
    finally:
        time.sleep(0.2)
        ended.set()  # the run has ended: the rest is printed, then follow_logs returns
        follower.join(timeout=10)
    assert not follower.is_alive()
    assert out.getvalue() == (b"step 1\nstep 2\nhalf a line\nlast wordsresumed at step 2\nstep 3\n"
                              b"no newline at the end")
    assert notes == ["attempt 1 began; following its logs"]


def test_logs_follow_of_every_rank_heads_each_file_and_waits_for_logs_to_appear(tmp_path: Path) -> None:
    out, ended = io.BytesIO(), threading.Event()
    follower = threading.Thread(target=follow_logs, args=(tmp_path, None, None, out),
                                kwargs={"ended": ended.is_set, "note": lambda _: None, "poll_s": 0.02,
                                        "check_every_s": 0.02})
    follower.start()
    time.sleep(0.2)  # no logs yet: the run has not started, so it waits
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-0.attempt-0.log").write_text("zero\n")
    time.sleep(0.2)
    (tmp_path / "logs" / "rank-1.attempt-0.log").write_text("one\n")
    time.sleep(0.2)
    ended.set()
    follower.join(timeout=10)
    logs = tmp_path / "logs"
    assert out.getvalue().decode() == (f"==> {logs / 'rank-0.attempt-0.log'} <==\nzero\n"
                                       f"==> {logs / 'rank-1.attempt-0.log'} <==\none\n")


def test_logs_follow_of_a_run_that_ended_without_logs_says_so(tmp_path: Path) -> None:
    from hpctrain.errors import ConfigError

    with pytest.raises(ConfigError, match="no logs yet"):
        follow_logs(tmp_path, None, None, io.BytesIO(), ended=lambda: True, note=lambda _: None)


def _status(step: int, state: str = "RUNNING") -> dict:
    return {"kind": "job", "state": state, "step": step, "steps": 100, "loss": 2.5, "tokens_per_s": 12345.6,
            "step_time_s": 0.5}


def test_progress_lines_come_every_n_seconds_and_on_a_change_of_state() -> None:
    now = [0.0]
    stream = io.StringIO()
    lines = _Lines(stream, every_s=30.0, clock=lambda: now[0])
    for second in range(0, 95, 5):  # a step every second, polled every 5 s
        now[0] = float(second)
        lines.update(_status(step=10 + second))
    now[0] = 96.0
    lines.update(_status(step=100, state="COMPLETED"))
    printed = stream.getvalue().splitlines()
    # at 0, 30, 60 and 90 s, then the end at once
    assert [line.split()[1] for line in printed] == ["10/100", "40/100", "70/100", "100/100", "100/100"], printed
    # the ETA from the pace it saw: 30 steps in 30 s, 60 steps left at 30 s
    assert printed[1] == "step 40/100 running loss 2.5000 12,346 tok/s ETA 0:01:00"
    assert printed[-1] == "step 100/100 completed loss 2.5000 12,346 tok/s"


def test_progress_line_before_two_steps_uses_the_step_time() -> None:
    assert progress_line(_status(step=20), None).endswith("ETA ?")
    lines = _Lines(io.StringIO(), every_s=30.0, clock=lambda: 0.0)
    assert lines.eta.seconds(20, 100, 0.5) == 40.0  # 80 steps of 0.5 s


def _job_file(tmp_path: Path) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text("name: t\nmodel: {preset: tiny}\ntrain: {micro_batch: 1, precision: fp32, steps: 2, "
                   "activation_checkpointing: none}\nparallel: {tp: 1, pp: 1}\n"
                   "cluster: {executor: local, nodes: 1, gpus_per_node: 1, gpu: a100-80gb}\n")
    return job


@pytest.mark.parametrize("option,env,expected", [
    (["--progress-every", "0"], {}, "--progress-every: must be a positive number of seconds (got 0)"),
    ([], {"HPCTRAIN_PROGRESS_EVERY_S": "often"}, "HPCTRAIN_PROGRESS_EVERY_S: expected a number of seconds"),
    (["--timeout", "-5"], {}, "--timeout: must be a positive number of seconds (got -5)"),
])
def test_bad_wait_options_submit_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                         option: list[str], env: dict[str, str], expected: str) -> None:
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["submit", str(_job_file(tmp_path)), "--wait", *option]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def _dry_run(runs: Path, name: str) -> Path:
    run = runs / name
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text(json.dumps({"time": "2026-01-01T00:00:00+00:00", "event": "dry_run",
                                                  "executor": "local"}) + "\n")
    return run


def test_status_hides_dry_runs_and_watch_ends_when_all_shown_have_ended(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    first = _dry_run(runs, "a-20260101-000000")
    _dry_run(runs, "b-20260101-000001")
    assert main(["status", "--runs-dir", str(runs)]) == 0
    assert capsys.readouterr().out == (f"no submitted runs in {runs}/ (2 dry runs hidden; `hpctrain status --all` "
                                       "lists them, `hpctrain clean --dry-runs` removes those that never ran)\n")
    assert main(["status", "--runs-dir", str(runs), "--all", "--watch", "0.1"]) == 0  # nothing runs: one snapshot
    out = capsys.readouterr().out
    assert out.startswith("--- ") and out.count("\n--- ") == 0 and out.count("DRY_RUN") == 2, out
    assert main(["status", str(first), "--watch", "0"]) == 2
    assert "--watch: must be a positive number of seconds (got 0)" in capsys.readouterr().err
    assert main(["status", "--watch", str(first), "--json"]) == 0  # --watch RUN: RUN is the run, not the interval
    assert [json.loads(line)["state"] for line in capsys.readouterr().out.splitlines()] == ["DRY_RUN"]  # JSON lines
    assert main(["follow", str(first)]) == 2  # a dry run never ran: nothing to follow
    assert "was never submitted (a dry run, or refused); nothing to follow" in capsys.readouterr().err


def test_status_watch_redraws_on_a_terminal(tmp_path: Path) -> None:
    """On a terminal each snapshot replaces the last (the screen is cleared first); off one, it is appended."""
    import os
    import pty
    import subprocess
    import sys

    runs = tmp_path / "runs"
    _dry_run(runs, "a-20260101-000000")
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; from hpctrain.cli import main; sys.exit(main())",
                               "status", "--runs-dir", str(runs), "--all", "--watch", "0.1"],
                              stdout=follower, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=60)
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
    assert proc.returncode == 0, proc.stderr
    assert out.startswith(b"\x1b[H\x1b[2J") and b"DRY_RUN" in out and b"--- 20" not in out, out


def test_follow_waits_by_default_as_long_as_the_job_may_run(tmp_path: Path) -> None:
    from hpctrain.launch.follow import run_timeout_s

    (tmp_path / "job.resolved.yaml").write_text("slurm: {time: '00:10:00'}\nrestart: {max_requeues: 2}\n")
    assert run_timeout_s(tmp_path) == 600 * 3 + 600  # each attempt's limit, plus 10 min
    tasks = [{"task_id": i, "run_dir": f"tasks/{i}"} for i in range(3)]
    (tmp_path / "sweep.json").write_text(json.dumps({"max_parallel": 2, "tasks": tasks}))
    assert run_timeout_s(tmp_path) == 2 * (600 * 3 + 600)  # 3 tasks, 2 at a time: two waves
    (tmp_path / "job.resolved.yaml").write_text("slurm: {time: null}\n")
    assert run_timeout_s(tmp_path) == 2 * 24 * 3600
