"""The operator's commands around a run: `status` lists runs, `resume --wait`, Ctrl-C of `--wait`, valid JSON.

Issue 11 (status lists runs; resume --wait) and issue 18 finding 8 (Ctrl-C says the job goes on and how to
cancel it; `status --json` never prints NaN). Real local runs of the tiny preset.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._helpers import CLI, log_tail, run_cli, run_dir_of, status_json, tiny_job, wait_status, write_job


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)  # python, and no Slurm client: executor auto -> local
    return {**env, **extra}


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_status_lists_runs_newest_first_and_resume_waits(tmp_path: Path) -> None:
    env = _env()
    old = tmp_path / "runs" / "older-20200101-000000"
    old.mkdir(parents=True)
    (old / "events.jsonl").write_text('{"time": "2020-01-01T00:00:00+00:00", "event": "dry_run", "executor": "local"}\n')
    job = tiny_job("again", steps=4, checkpoint={"every_steps": 2})
    first = run_cli(["submit", str(write_job(tmp_path, job)), "--wait", "--timeout", "120"], cwd=tmp_path, env=env)
    run_dir = run_dir_of(first)
    assert first.returncode == 0, f"{first.stderr}\n{log_tail(run_dir)}"
    shutil.rmtree(run_dir / "checkpoints" / "step-4")
    again = run_cli(["resume", str(run_dir), "--set", "train.steps=6", "--wait", "--timeout", "120"],
                    cwd=tmp_path, env=env)
    assert again.returncode == 0, f"{again.stderr}\n{log_tail(run_dir)}"
    assert "COMPLETED at step 6" in again.stdout  # it waited for the end, as submit --wait does

    listed = run_cli(["status"], cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["run", "state", "step", "restarts", "age"]
    assert [line.split()[:3] for line in lines[2:-1]] == [[run_dir.name, "COMPLETED", "6/6"]]
    assert lines[-1] == ("(1 dry run hidden; `hpctrain status --all` lists them, "  # issue 29: dry runs piled up
                         "`hpctrain clean --dry-runs` removes those that never ran)")
    lines = run_cli(["status", "--all"], cwd=tmp_path, env=env).stdout.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == [run_dir.name, old.name]  # newest first
    assert rows[0][1:3] == ["COMPLETED", "6/6"] and rows[1][1] == "DRY_RUN"
    assert rows[1][-1].endswith("d")  # created years ago
    assert [r["name"] for r in _strict_json(run_cli(["status", "--json"], cwd=tmp_path, env=env).stdout)] == [
        run_dir.name]
    as_json = _strict_json(run_cli(["status", "--json", "--all"], cwd=tmp_path, env=env).stdout)
    assert [(r["name"], r["state"], r["step"]) for r in as_json] == [(run_dir.name, "COMPLETED", 6),
                                                                      (old.name, "DRY_RUN", None)]
    assert as_json[0]["restarts"] >= 0 and as_json[0]["age_s"] >= 0


def test_status_json_has_no_nan(tmp_path: Path) -> None:
    """Finding 8: a diverged loss is NaN in metrics.jsonl (Python's json writes it); `status --json` prints null."""
    run_dir = tmp_path / "runs" / "nan-20260101-000000"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text('{"time": "2026-01-01T00:00:00+00:00", "event": "dry_run"}\n')
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": float("nan"),
                                                       "tokens_per_s": float("inf")}) + "\n")
    for args in (["status", str(run_dir), "--json"], ["status", "--json", "--all"]):
        result = run_cli(args, cwd=tmp_path, env=_env())
        assert result.returncode == 0, result.stderr
        data = _strict_json(result.stdout)
        row = data if isinstance(data, dict) else data[0]
        assert row["step"] == 3 and row.get("loss", None) is None


def _like_a_terminal_foreground_job() -> None:
    """Ctrl-C reaches a command typed at a terminal with SIGINT at its default and unblocked; a test
    run can inherit it ignored or blocked (a background CI shell, a library's thread), so set it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_of_wait_says_the_job_goes_on_and_how_to_cancel_it(tmp_path: Path) -> None:
    """Finding 8: Ctrl-C stops the following, not the job; the message says so and gives the cancel command."""
    env = _env(HPCTRAIN_TEST_STEP_DELAY_S="0.1")
    job = tiny_job("ctrlc", steps=3000)  # bounded: a job leaked by a failed test ends by itself
    out_path, err_path = tmp_path / "client.out", tmp_path / "client.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        client = subprocess.Popen([*CLI, "submit", str(write_job(tmp_path, job)), "--wait"], cwd=tmp_path, env=env,
                                  stdout=out, stderr=err, text=True, preexec_fn=_like_a_terminal_foreground_job)
    run_dir = None
    try:
        deadline = time.monotonic() + 90
        while "running" not in err_path.read_text():  # the client is following the running job
            assert time.monotonic() < deadline and client.poll() is None, err_path.read_text()
            time.sleep(0.2)
        run_dir = next((tmp_path / "runs").iterdir())
        client.send_signal(signal.SIGINT)  # what Ctrl-C sends to the terminal's foreground process
        client.wait(timeout=30)
        message = err_path.read_text()
        assert client.returncode == 130, message
        assert "goes on" in message and f"hpctrain cancel {run_dir}" in message and "Traceback" not in message
        assert f"follow it again: hpctrain follow {run_dir}" in message  # a command that follows, not a snapshot
        assert status_json(run_dir, env)["state"] == "RUNNING"  # the job did go on
    finally:
        if client.poll() is None:
            client.kill()
        if run_dir is not None:
            cancel = run_cli(["cancel", str(run_dir)], cwd=tmp_path, env=env, timeout_s=30)
    assert cancel.returncode == 0, cancel.stderr
    wait_status(run_dir, env, lambda s: s["state"] == "CANCELLED", 60, "the cancel")
