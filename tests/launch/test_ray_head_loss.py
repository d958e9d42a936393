"""Issue 30, Why 11: a Ray job whose head dies (only its `gcs_server` killed) — the driver stops its
ranks and exits with the reason in the run, and `status` settles on FAILED once a new head at the same
address does not know the job, instead of UNKNOWN forever.

This module gives each test its own Ray head (tests/ray_cluster.py): killing a head's GCS must not touch
another test's head. The head's own processes are found through its session (RayCluster.gcs_pid).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from hpctrain.rundir.events import FAILED, RAY_HEAD_GONE, RAY_HEAD_LOST_JOB

from ._helpers import REPO, log_tail, run_cli, run_dir_of, status_json, tiny_job, wait_status, write_job

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'hpctrain[ray]')")

try:  # tests/ is on sys.path under pytest's default import mode
    from ray_cluster import RayCluster
except ModuleNotFoundError:  # imported as tests.launch.test_ray_head_loss
    from tests.ray_cluster import RayCluster  # type: ignore[no-redef]

pytestmark = pytest.mark.slow

LOST_AFTER_S = 15  # HPCTRAIN_RAY_LOST_AFTER_S for the status calls of this test (the default is minutes)
DRIVER_EXIT_S = 45  # the driver's watchdog gives up after HEAD_MISSES checks (~10 s); Ray's raylet waits 60 s


def _processes(run_dir: Path, module: bytes) -> list[int]:
    """Processes whose command line runs `module` for this run directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if module in argv and str(run_dir).encode() in argv:
                pids.append(int(entry.name))
    return pids


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(500)
def test_killing_the_gcs_stops_the_driver_and_status_settles_on_failed(tmp_path: Path) -> None:
    head = RayCluster(tmp_path / "ray-a.log", cpus=1, pythonpath=str(REPO))
    try:
        head.start()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    new_head: Optional[RayCluster] = None
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": head.address,
               "HPCTRAIN_TEST_STEP_DELAY_S": "0.5", "HPCTRAIN_RAY_LOST_AFTER_S": str(LOST_AFTER_S)}
        job = tiny_job("headloss", executor="ray", gpus_per_node=1, steps=400, gpu="cpu")
        submitted = run_cli(["submit", str(write_job(tmp_path, job))], cwd=tmp_path, env=env)
        assert submitted.returncode == 0, submitted.stderr
        run_dir = run_dir_of(submitted)
        deadline = time.monotonic() + 180
        while len(_steps(run_dir)) < 2:
            assert time.monotonic() < deadline, f"the run did not start\n{log_tail(run_dir)}"
            time.sleep(0.5)
        drivers = _processes(run_dir, b"hpctrain.launch.ray.driver")
        assert len(drivers) == 1, drivers

        gcs = head.gcs_pid()
        assert gcs is not None, "no gcs_server in this head's session"
        os.kill(gcs, signal.SIGKILL)  # only the GCS: the raylet, the dashboard and the job's processes live on
        killed = time.monotonic()
        while _processes(run_dir, b"hpctrain.launch.ray.driver") or _processes(run_dir, b"hpctrain.runtime"):
            assert time.monotonic() - killed < DRIVER_EXIT_S, (
                f"driver/ranks still there {DRIVER_EXIT_S} s after the GCS died\n{log_tail(run_dir)}")
            time.sleep(0.5)
        failed = [e for e in _events(run_dir) if e["event"] == FAILED]
        assert [e.get("reason") for e in failed] == [RAY_HEAD_GONE], failed
        assert "starting attempt 1" not in (run_dir / "logs" / "ray-driver.log").read_text()

        # A new head at the same address: it answers, and does not know the job.
        ports = (head.gcs_port, head.dashboard_port)
        head.stop()
        new_head = RayCluster(tmp_path / "ray-b.log", cpus=1, pythonpath=str(REPO), ports=ports)
        new_head.start()
        quiet = max(p.stat().st_mtime for p in [run_dir / "events.jsonl", *run_dir.glob("logs/*")])
        if time.time() - quiet < LOST_AFTER_S - 3:  # within the window the answer is not final yet
            early = status_json(run_dir, env)
            if time.time() - quiet < LOST_AFTER_S:  # the call decided inside the window (a loaded machine is slow)
                assert early["state"] == "UNKNOWN", early
        final = wait_status(run_dir, env, lambda s: s["state"] != "UNKNOWN", LOST_AFTER_S + 60,
                            "status to settle")
        assert final["state"] == "FAILED", final
        assert RAY_HEAD_LOST_JOB in (final["reason"] or ""), final
        assert time.time() - quiet < LOST_AFTER_S + 60
    finally:
        if new_head is not None:
            new_head.stop()
        head.stop()
