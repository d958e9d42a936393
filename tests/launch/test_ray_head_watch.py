"""Issue 30, Why 11, without a Ray head: the driver's watchdog against a real TCP listener standing in for
the GCS, stopping ranks by pid, and `status`'s bounded wait before a job its head lost is FAILED.
The end-to-end case with a real head whose gcs_server is killed is tests/launch/test_ray_head_loss.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpctrain.launch.ray.executor import NO_ANSWER, NOT_KNOWN, RayExecutor, lost_after, settle
from hpctrain.rundir.events import FAILED, FINISHED, RAY_HEAD_GONE, RAY_HEAD_LOST_JOB, SUBMITTED, append_event

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'hpctrain[ray]')")
from hpctrain.launch.ray.driver import HeadWatch, gcs_host_port, stop_pids  # noqa: E402  (imports ray)


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def test_the_watchdog_fires_only_after_the_gcs_stops_answering() -> None:
    sock = _listener()
    gone = threading.Event()
    watch = HeadWatch("127.0.0.1", sock.getsockname()[1], gone.set, every_s=0.1, misses=3).start()
    try:
        assert not gone.wait(1.0), "fired while the GCS answered"
        assert watch.missed == 0
        sock.close()  # the head's GCS dies: its port refuses connections
        closed = time.monotonic()
        assert gone.wait(5.0), "did not fire after the GCS stopped answering"
        assert time.monotonic() - closed < 3.0
    finally:
        watch.stop()
        sock.close()


def test_one_missed_check_is_forgiven() -> None:
    sock = _listener()
    port = sock.getsockname()[1]
    gone = threading.Event()
    watch = HeadWatch("127.0.0.1", port, gone.set, every_s=0.2, misses=5).start()
    try:
        sock.close()
        time.sleep(0.5)  # two or three misses, fewer than five
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # the GCS is back at the same port
        sock.listen(16)
        assert not gone.wait(1.5), "fired although the GCS came back within the misses"
        assert watch.missed == 0
    finally:
        watch.stop()
        sock.close()


def test_gcs_address_parsing() -> None:
    assert gcs_host_port("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert gcs_host_port("ray://head:10001") == ("head", 10001)
    assert gcs_host_port("[::1]:6379") == ("::1", 6379)


def test_stop_pids_kills_this_runs_ranks_and_nothing_else(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # A rank that ignores SIGTERM (stuck in a collective): SIGKILL after the grace.
    # Each says "ready" once set up: under load an interpreter takes more than a fixed sleep to get there.
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)", "--run-dir",
                                 str(run_dir)], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)",
                              "--run-dir", str(tmp_path / "x")], stdout=subprocess.PIPE, text=True)
    try:
        for proc in (stubborn, other):
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        stop_pids([stubborn.pid, other.pid], run_dir, grace_s=0.5)
        assert stubborn.wait(5) == -signal.SIGKILL
        assert time.monotonic() - started < 5
        assert other.poll() is None, "a process of another run (a reused pid) was signalled"
    finally:
        for proc in (stubborn, other):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _aged(run_dir: Path, seconds: float) -> None:
    """Make every file of the run look `seconds` old (what a quiet run looks like)."""
    past = time.time() - seconds
    for path in [run_dir / "events.jsonl", *run_dir.glob("logs/*")]:
        os.utime(path, (past, past))


def test_a_job_the_head_lost_is_unknown_within_the_bound_then_failed(tmp_path: Path) -> None:
    append_event(tmp_path, SUBMITTED, job_id="raysubmit_1", executor="ray")
    append_event(tmp_path, FAILED, stage="ray-driver", reason=RAY_HEAD_GONE)
    state, reason = settle(tmp_path, "the Ray head at X does not know job raysubmit_1", NOT_KNOWN, (60, 300))
    assert state == "UNKNOWN" and "60 s more" in (reason or ""), reason  # just written: within the window
    _aged(tmp_path, 61)
    state, reason = settle(tmp_path, "not known", NOT_KNOWN, (60, 300))
    assert state == "FAILED" and RAY_HEAD_LOST_JOB in (reason or "") and RAY_HEAD_GONE in (reason or ""), reason
    # A head that does not answer is given longer: the way to it may be down while the job runs.
    assert settle(tmp_path, "no answer", NO_ANSWER, (60, 300))[0] == "UNKNOWN"
    _aged(tmp_path, 301)
    assert settle(tmp_path, "no answer", NO_ANSWER, (60, 300))[0] == "FAILED"


def test_a_lost_job_whose_training_finished_is_completed(tmp_path: Path) -> None:
    append_event(tmp_path, SUBMITTED, job_id="raysubmit_1", executor="ray")
    append_event(tmp_path, FINISHED, step=4)
    _aged(tmp_path, 100)
    assert settle(tmp_path, "not known", NOT_KNOWN, (60, 300)) == ("COMPLETED", None)
    append_event(tmp_path, SUBMITTED, job_id="raysubmit_2", executor="ray")  # a resume: its own verdict
    _aged(tmp_path, 100)
    assert settle(tmp_path, "not known", NOT_KNOWN, (60, 300))[0] == "FAILED"


def test_status_of_a_ray_run_whose_head_is_gone_settles_on_failed(tmp_path: Path) -> None:
    port = _listener()
    address = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()  # nothing answers there now
    append_event(tmp_path, SUBMITTED, job_id="raysubmit_1", executor="ray", address=address)
    executor = RayExecutor(env={"HPCTRAIN_RAY_LOST_AFTER_S": "30"})
    states = executor.state({"address": address}, [("raysubmit_1", tmp_path)])
    assert states["raysubmit_1"].state == "UNKNOWN", states
    _aged(tmp_path, 31)
    states = executor.state({"address": address}, [("raysubmit_1", tmp_path)])
    assert states["raysubmit_1"].state == "FAILED", states
    assert RAY_HEAD_LOST_JOB in (states["raysubmit_1"].reason or "")


def test_the_bounds_default_to_minutes_and_the_variable_sets_both() -> None:
    assert lost_after({}) == (60.0, 300.0)
    assert lost_after({"HPCTRAIN_RAY_LOST_AFTER_S": "5"}) == (5.0, 5.0)
    assert lost_after({"HPCTRAIN_RAY_LOST_AFTER_S": "nan"}) == (60.0, 300.0)
    assert lost_after({"HPCTRAIN_RAY_LOST_AFTER_S": "soon"}) == (60.0, 300.0)
