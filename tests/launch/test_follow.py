"""Following a run (issue 29, "Following a run"): `hpctrain follow`, `logs -f`, `status --watch`, `sweep --wait`,
the progress lines off a terminal and the exit code of a wait that timed out. Real local runs of the tiny
preset; HPCTRAIN_TEST_STEP_DELAY_S keeps a run going long enough to be followed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ._helpers import CLI, log_tail, run_cli, run_dir_of, tiny_job, wait_status, write_job


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCTRAIN_PROGRESS"))}
    env["PATH"] = os.path.dirname(sys.executable)  # python, and no Slurm client: executor auto -> local
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _start(args: list[str], cwd: Path, env: dict[str, str], name: str) -> tuple[subprocess.Popen[str], Path, Path]:
    """The CLI in the background, its stdout and stderr to files (not a terminal)."""
    out, err = cwd / f"{name}.out", cwd / f"{name}.err"
    with open(out, "w") as out_file, open(err, "w") as err_file:
        proc = subprocess.Popen([*CLI, *args], cwd=cwd, env=env, stdout=out_file, stderr=err_file, text=True,
                                stdin=subprocess.DEVNULL)
    return proc, out, err


def _finish(proc: subprocess.Popen[str], timeout_s: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{proc.args} did not end in {timeout_s:g} s") from None


def _wait_for_line(path: Path, pattern: re.Pattern[str], timeout_s: float) -> None:
    """Until a follower has written a line matching `pattern` to `path`."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and pattern.search(path.read_text())):
        if time.monotonic() > deadline:
            raise AssertionError(f"no line matching {pattern.pattern!r} in {path} after {timeout_s:g} s: "
                                 f"{path.read_text() if path.exists() else ''}")
        time.sleep(0.1)


PROGRESS = re.compile(r"^step (\d+)/20 running loss \d+\.\d{4} [\d,]+ tok/s ETA \d+:\d\d:\d\d$", re.M)


def test_follow_logs_f_and_status_watch_see_one_run_to_its_end(tmp_path: Path) -> None:
    """One run, three followers started while it runs: each ends by itself when the run ends, with exit 0."""
    env = _env(HPCTRAIN_TEST_STEP_DELAY_S="0.2")
    submitted = run_cli(["submit", str(write_job(tmp_path, tiny_job("followed", steps=20)))], cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    run_dir = run_dir_of(submitted)
    follow, follow_out, follow_err = _start(["follow", str(run_dir), "--progress-every", "1"], tmp_path, env, "follow")
    logs, logs_out, logs_err = _start(["logs", str(run_dir), "-f"], tmp_path, env, "logs")
    watch, watch_out, _ = _start(["status", str(run_dir), "--watch", "1"], tmp_path, env, "watch")
    try:
        assert _finish(follow) == 0, f"{follow_err.read_text()}\n{log_tail(run_dir)}"
        assert _finish(logs) == 0, logs_err.read_text()
        assert _finish(watch) == 0
    finally:
        for proc in (follow, logs, watch):
            if proc.poll() is None:
                proc.kill()

    # follow: progress lines off a terminal (step, loss, tok/s, ETA), then the final state on stdout
    assert follow_out.read_text().splitlines() == ["COMPLETED at step 20"]
    progress = [int(step) for step in PROGRESS.findall(follow_err.read_text())]
    assert len(progress) >= 2 and progress == sorted(progress), follow_err.read_text()
    assert progress[0] < 20  # it saw the run going, not only its end
    # logs -f: what rank 0 logged while it was followed, up to the last step
    logged = [int(step) for step in re.findall(r"^step\s+(\d+) \|", logs_out.read_text(), re.M)]
    assert logged == list(range(1, 21)), logs_out.read_text()[-2000:]
    # status --watch 1: a snapshot per second while it ran, the last one the final state
    snapshots = watch_out.read_text().split("\n--- ")
    assert len(snapshots) >= 2 and "RUNNING" in snapshots[0] and "COMPLETED" in snapshots[-1], watch_out.read_text()
    assert "tokens/s (last)" in snapshots[-1]

    again = run_cli(["follow", str(run_dir)], cwd=tmp_path, env=env, timeout_s=60)  # an ended run: at once
    assert again.returncode == 0 and again.stdout.splitlines() == ["COMPLETED at step 20"], again.stderr


def test_sweep_wait_times_out_with_exit_4_and_follow_reports_each_task(tmp_path: Path) -> None:
    """A wait that runs out exits 4 (not 1: nothing failed) and says how to follow the run again; `follow` of the
    sweep ends when every task has ended, one line per task, exit 1 when one did not complete."""
    env = _env(HPCTRAIN_TEST_STEP_DELAY_S="0.1")
    job = tiny_job("waited", steps=3000, sweep={"grid": {"train.steps": [3, 3000]}, "max_parallel": 2})
    started = time.monotonic()
    waited = run_cli(["sweep", str(write_job(tmp_path, job)), "--wait", "--timeout", "8"], cwd=tmp_path, env=env)
    run_dir = run_dir_of(waited)
    try:
        assert waited.returncode == 4, f"{waited.stderr}\n{log_tail(run_dir)}"
        assert time.monotonic() - started < 60
        assert "timed out after 8 s" in waited.stderr and f"hpctrain follow {run_dir}" in waited.stderr
        assert f"hpctrain cancel {run_dir}" in waited.stderr and "Traceback" not in waited.stderr
        follow, follow_out, follow_err = _start(["follow", str(run_dir), "--progress-every", "1"], tmp_path, env,
                                                "follow")
        wait_status(run_dir, env, lambda s: s["tasks"][0]["state"] == "COMPLETED", 120, "task 0 to complete")
        # follow's first summary while task 1 still runs: its start is slow on a busy machine, so wait for it before
        # the cancel below, or its first summary is already the end (1 CANCELLED, 1 COMPLETED)
        _wait_for_line(follow_err, re.compile(r"^sweep: .* of 2 tasks$", re.M), 60)
        assert follow.poll() is None  # task 1 goes on
    finally:
        cancel = run_cli(["cancel", str(run_dir)], cwd=tmp_path, env=env, timeout_s=60)
    assert cancel.returncode == 0, cancel.stderr
    assert _finish(follow) == 1, follow_err.read_text()
    lines = follow_out.read_text().splitlines()
    assert lines[0] == "task 0 train.steps=3: COMPLETED at step 3/3", lines
    assert lines[1].startswith("task 1 train.steps=3000: CANCELLED"), lines
    assert lines[2] == "1 of 2 tasks completed"
    # Task 0 (3 steps) may have completed before `follow` started, on a busy machine: either summary counts.
    summary = r"^sweep: (?:(?:2 RUNNING)|(?:1 COMPLETED, 1 RUNNING)) of 2 tasks$"
    assert re.search(summary, follow_err.read_text(), re.M), follow_err.read_text()
