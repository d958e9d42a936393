"""The local executor under faults, with real processes and real signals (issue 18, findings 1, 3 and 8).

Each test starts the real CLI and the real runtime on the tiny preset; HPCTRAIN_TEST_STEP_DELAY_S
slows the steps down so that a fault lands mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpctrain.rundir import lock

from ._helpers import CLI, log_tail, probe_env, read_probes, run_cli, status_json, tiny_job, wait_status, write_job

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "STOPPED"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)  # python, and no Slurm client: executor auto -> local
    return {**env, **extra}


def _pids(folder: Path) -> list[int]:
    """The pids of the runtime ranks that the probe (tests/launch/_helpers.py) saw start."""
    return sorted(int(p.stem) for p in folder.glob("*.json"))


def _alive(pid: int) -> bool:
    return lock.pid_alive(pid)


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _start(tmp_path: Path, env: dict[str, str], job: dict[str, Any]) -> Path:
    result = run_cli(["submit", str(write_job(tmp_path, job))], cwd=tmp_path, env=env, timeout_s=60)
    assert result.returncode == 0, result.stderr
    return Path(next(line[4:] for line in result.stdout.splitlines() if line.startswith("run ")))


def _slow_job(name: str, steps: int = 24) -> dict[str, Any]:
    return tiny_job(name, gpus_per_node=2, steps=steps, checkpoint={"every_steps": 4})


def test_ranks_die_with_a_killed_supervisor_and_resume_writes_each_step_once(tmp_path: Path) -> None:
    """Finding 1: SIGKILL of the local supervisor must not leave its ranks training as orphans."""
    probe, probes = probe_env(tmp_path)
    env = _env(HPCTRAIN_TEST_STEP_DELAY_S="0.15", **probe)
    run_dir = _start(tmp_path, env, _slow_job("orphans"))
    wait_status(run_dir, env, lambda s: (s["step"] or 0) >= 6, 90, "step 6")
    supervisor = json.loads((run_dir / "submit" / "local.json").read_text())["pid"]
    ranks = _pids(probes)
    assert len(ranks) == 2 and all(_alive(p) for p in ranks)
    os.kill(supervisor, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks), f"ranks {ranks} outlived their supervisor"
    assert status_json(run_dir, env)["state"] == "FAILED"
    doctor = run_cli(["doctor", str(run_dir), "--json", "--no-scheduler"], cwd=tmp_path, env=env, timeout_s=60)
    assert json.loads(doctor.stdout)["state"] == "failed", doctor.stdout  # not "running": the supervisor is dead
    again = run_cli(["resume", str(run_dir)], cwd=tmp_path, env=_env(**probe), timeout_s=60)
    assert again.returncode == 0, again.stderr
    status = wait_status(run_dir, env, lambda s: s["state"] in TERMINAL, 120, "the resumed run to end")
    assert (status["state"], status["step"]) == ("COMPLETED", 24), log_tail(run_dir)
    assert _steps(run_dir) == list(range(1, 25))  # each step once: nobody else wrote to metrics.jsonl


_HOLDER = """
import sys, time
from pathlib import Path
from hpctrain.rundir.lock import acquire
held = acquire(Path(sys.argv[1]), "local-test")
held.update(ranks=[12345])
print("held", flush=True)
time.sleep(60)
"""


def test_a_run_directory_refuses_a_second_live_set_of_ranks(tmp_path: Path) -> None:
    """Finding 1: the lock names its live owner (exit 2 from resume); a dead owner's lock is taken over."""
    run_dir = tmp_path / "run"
    (run_dir / "submit").mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(lock.__file__).parents[2])})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(lock.RunLockedError) as caught:
            lock.acquire(run_dir)
        message = str(caught.value)
        assert f"host {socket.gethostname()}, pid {holder.pid}" in message and "job local-test" in message
        assert len(message.splitlines()) == 1
        (run_dir / "job.yaml").write_text("name: x\n")
        result = run_cli(["resume", str(run_dir)], cwd=tmp_path, env=_env(), timeout_s=60)
        assert result.returncode == 2 and f"pid {holder.pid}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    finally:
        holder.kill()
        holder.wait()
    assert lock.live_owner(run_dir) is None  # SIGKILLed owner: its lock went with it
    taken = lock.acquire(run_dir, "local-next")
    assert lock.read_owner(lock.lock_path(run_dir)).job_id == "local-next"  # type: ignore[union-attr]
    taken.release()


def test_a_stray_sigterm_ends_stopped_and_resume_continues(tmp_path: Path) -> None:
    """Finding 3: `kill -TERM` of one rank, no cancel asked for, nothing requeues: STOPPED (exit 1), not
    COMPLETED; status and the doctor say so; resume continues to the last step."""
    probe, probes = probe_env(tmp_path)
    env = _env(HPCTRAIN_TEST_STEP_DELAY_S="0.15", **probe)
    client = subprocess.Popen([*CLI, "submit", str(write_job(tmp_path, _slow_job("stray"))), "--wait",
                               "--timeout", "150"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not list((tmp_path / "runs").glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.2)
        run_dir = next((tmp_path / "runs").iterdir())
        wait_status(run_dir, env, lambda s: (s["step"] or 0) >= 5, 90, "step 5")
        ranks = _pids(probes)
        os.kill(ranks[1], signal.SIGTERM)
        out, err = client.communicate(timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 1, f"{out}\n{err}\n{log_tail(run_dir)}"
    assert "STOPPED" in err and "COMPLETED" not in out + err
    status = status_json(run_dir, env)
    step = status["step"]
    assert status["state"] == "STOPPED" and 5 <= step < 24, status
    assert "signal TERM" in status["reason"] and "hpctrain resume" in status["reason"]
    doctor = run_cli(["doctor", str(run_dir)], cwd=tmp_path, env=env, timeout_s=60)
    assert doctor.returncode == 1 and f"stopped at step {step} of 24" in doctor.stdout, doctor.stdout
    again = run_cli(["resume", str(run_dir)], cwd=tmp_path, env=_env(), timeout_s=60)
    assert again.returncode == 0, again.stderr
    status = wait_status(run_dir, env, lambda s: s["state"] in TERMINAL, 120, "the resumed run to end")
    assert (status["state"], status["step"]) == ("COMPLETED", 24), log_tail(run_dir)
    assert _steps(run_dir) == list(range(1, 25))


def test_nccl_env_reaches_the_local_ranks(tmp_path: Path) -> None:
    """Finding 8: nccl.env is exported to the ranks by the batch script on Slurm; locally too."""
    probe, probes = probe_env(tmp_path)
    env = _env(**probe, HPCTRAIN_PROBE_KEYS="NCCL_DEBUG")
    job = tiny_job("nccl", steps=1, nccl={"env": {"NCCL_DEBUG": "WARN"}})
    result = run_cli(["submit", str(write_job(tmp_path, job)), "--wait", "--timeout", "90"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    seen = read_probes(probes)
    assert seen and all(record.get("NCCL_DEBUG") == "WARN" for record in seen), seen


def _fill(path: Path) -> None:
    """Write zeros until the file system is full, to the last byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (65536, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


NEEDS_ROOT = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="a real full disk is a small tmpfs, and mounting one needs root")


@NEEDS_ROOT
def test_a_full_runs_dir_is_recorded_not_left_running(tmp_path: Path) -> None:
    """Finding 8: the disk of runs_dir fills up mid-run; the supervisor records FAILED (it used to die and
    leave `local.json` at RUNNING) and status reports no RUNNING job for a dead supervisor."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        env = _env(HPCTRAIN_TEST_STEP_DELAY_S="0.1")
        # bounded steps: a job leaked by a failed test ends by itself
        run_dir = _start(tmp_path, env, tiny_job("full", steps=3000, runs_dir=str(disk / "runs")))
        wait_status(run_dir, env, lambda s: (s["step"] or 0) >= 2, 90, "step 2")
        _fill(disk / "filler")
        status = wait_status(run_dir, env, lambda s: s["state"] != "RUNNING", 60, "the job to end")
        assert status["state"] == "FAILED", status
        recorded = json.loads((run_dir / "submit" / "local.json").read_text())
        assert recorded["state"] == "FAILED", recorded
        deadline = time.monotonic() + 10
        while _alive(recorded["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(recorded["pid"])
    finally:
        for runs in (disk / "runs").glob("*"):  # a failed test must not leave its job training
            run_cli(["cancel", str(runs)], cwd=tmp_path, env=_env(), timeout_s=30)
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@NEEDS_ROOT
def test_submitting_into_a_full_runs_dir_is_one_line_exit_2(tmp_path: Path) -> None:
    """Finding 8 (a full runs_dir): the submit itself says which file and what to do, no traceback."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        _fill(disk / "filler")
        job = tiny_job("fullsub", runs_dir=str(disk / "runs"))
        result = run_cli(["submit", str(write_job(tmp_path, job))], cwd=tmp_path, env=_env(), timeout_s=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("runs_dir: cannot write ") and "No space left" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
