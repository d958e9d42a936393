"""cluster.executor: ray on a real local Ray cluster (head only, loopback, 2 CPUs, dashboard for the Jobs API).

The fixture (tests/ray_cluster.py) stops the head by its own pid and session, never with `ray stop`,
which would stop every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ._helpers import REPO, log_tail, run_cli, run_dir_of, status_json, tiny_job, wait_status, write_job

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'hpctrain[ray]')")

try:  # tests/ is on sys.path under pytest's default import mode
    from ray_cluster import RayCluster
except ModuleNotFoundError:  # imported as tests.launch.test_ray
    from tests.ray_cluster import RayCluster  # type: ignore[no-redef]

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Jobs API address of a fresh local Ray head; the cluster sees this checkout of hpctrain."""
    cluster = RayCluster(tmp_path_factory.mktemp("ray") / "ray-start.log", cpus=2, pythonpath=str(REPO))
    try:
        cluster.start()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield cluster.address
    finally:
        cluster.stop()


def _job(name: str, steps: int, **extra: Any) -> dict[str, Any]:
    job = tiny_job(name, executor="ray", gpus_per_node=2, steps=steps, gpu="cpu", **extra)
    job["train"]["global_batch"] = 4
    return job


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {m["step"]: m["loss"] for m in lines if "loss" in m}


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def _cli_env(address: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": address, **extra}


@pytest.mark.timeout(400)
def test_two_workers_train_like_the_local_executor(ray_cluster: str, tmp_path: Path) -> None:
    env = _cli_env(ray_cluster)
    submitted = run_cli(["submit", str(write_job(tmp_path, _job("ray2", 4)))], cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    assert "executor: ray" in submitted.stderr, submitted.stderr
    run_dir = run_dir_of(submitted)
    status = wait_status(run_dir, env, lambda s: s["state"] in TERMINAL, 300, "the Ray job")
    assert status["state"] == "COMPLETED", f"{status}\n{log_tail(run_dir)}"
    assert status["executor"] == "ray" and status["step"] == 4

    local_dir = tmp_path / "local"
    local_dir.mkdir()
    local_env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    local_env["PATH"] = os.path.dirname(sys.executable)
    local = run_cli(["submit", str(write_job(local_dir, _job("local2", 4, cluster={"executor": "local"})))],
                    cwd=local_dir, env=local_env)
    assert local.returncode == 0, local.stderr
    local_run = run_dir_of(local)
    wait_status(local_run, local_env, lambda s: s["state"] in TERMINAL, 240, "the local job")
    ray_losses, local_losses = _losses(run_dir), _losses(local_run)
    assert sorted(ray_losses) == [1, 2, 3, 4] and sorted(local_losses) == [1, 2, 3, 4]
    assert max(abs(ray_losses[s] - local_losses[s]) for s in ray_losses) <= 1e-5, (ray_losses, local_losses)

    started = [e for e in _events(run_dir) if e["event"] == "started"]
    assert started and started[0]["world_size"] == 2, started
    for rank in (0, 1):  # `logs` shows each worker's log
        shown = run_cli(["logs", str(run_dir), "--rank", str(rank)], cwd=tmp_path, env=env)
        assert shown.returncode == 0 and f"rank {rank} of 2" in shown.stdout, shown
    driver = (run_dir / "logs" / "ray-driver.log").read_text()
    assert "attempt 0: 2 rank(s)" in driver and "training finished" in driver, driver
    assert (run_dir / "logs" / "rank-0.attempt-0.log").is_file() and (run_dir / "logs" / "rank-1.attempt-0.log").is_file()


def _rank_pids(run_dir: Path) -> list[int]:
    """The runtime processes of this run (their command line names its run directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"hpctrain.runtime" in argv and str(run_dir).encode() in argv:
                pids.append(int(entry.name))
    return pids


@pytest.mark.timeout(400)
def test_a_killed_worker_is_restarted_from_the_checkpoint_and_cancel_stops_it(ray_cluster: str,
                                                                              tmp_path: Path) -> None:
    env = _cli_env(ray_cluster, HPCTRAIN_TEST_STEP_DELAY_S="0.7")
    job = _job("raykill", 40, checkpoint={"every_steps": 2, "keep_last": 5}, slurm={"max_requeues": 2})
    submitted = run_cli(["submit", str(write_job(tmp_path, job))], cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    run_dir = run_dir_of(submitted)
    deadline = time.monotonic() + 180
    while not list((run_dir / "checkpoints").glob("step-4")):
        assert time.monotonic() < deadline, f"no checkpoint in time\n{log_tail(run_dir)}"
        time.sleep(0.5)
    pids = _rank_pids(run_dir)
    assert len(pids) == 2, pids
    os.kill(pids[-1], signal.SIGKILL)  # one worker's rank dies mid-run

    deadline = time.monotonic() + 240
    while not [e for e in _events(run_dir) if e["event"] == "resumed"]:
        assert time.monotonic() < deadline, f"no resume in time\n{log_tail(run_dir)}"
        time.sleep(0.5)
    events = _events(run_dir)
    requeued = [e for e in events if e["event"] == "requeued"]
    assert [(e["reason"], e["attempt"]) for e in requeued] == [("rank-crashed", 0)], requeued
    resumed = [e for e in events if e["event"] == "resumed"][-1]
    assert resumed["step"] >= 4
    status = status_json(run_dir, env)
    assert status["state"] == "RUNNING" and status["restarts"] >= 1, status

    cancelled = run_cli(["cancel", str(run_dir)], cwd=tmp_path, env=env)
    assert cancelled.returncode == 0, cancelled.stderr
    final = wait_status(run_dir, env, lambda s: s["state"] in TERMINAL, 60, "the cancelled Ray job")
    assert final["state"] == "CANCELLED", final
    deadline = time.monotonic() + 30
    while _rank_pids(run_dir):
        assert time.monotonic() < deadline, f"ranks still running after cancel: {_rank_pids(run_dir)}"
        time.sleep(0.5)
    assert (final["step"] or 0) < 40

    # `resume` sends a new Ray job that continues from the newest checkpoint to the last step.
    fast = {k: v for k, v in env.items() if k != "HPCTRAIN_TEST_STEP_DELAY_S"}
    resumed_run = run_cli(["resume", str(run_dir)], cwd=tmp_path, env=fast)
    assert resumed_run.returncode == 0, resumed_run.stderr
    done = wait_status(run_dir, fast, lambda s: s["state"] in TERMINAL and s["job_id"] != final["job_id"], 240,
                       "the resumed Ray job")
    assert done["state"] == "COMPLETED" and done["step"] == 40, f"{done}\n{log_tail(run_dir)}"
    last_resume = [e for e in _events(run_dir) if e["event"] == "resumed"][-1]
    assert last_resume["step"] >= resumed["step"], last_resume


@pytest.mark.timeout(400)
def test_the_own_script_example_runs_unchanged_on_ray(ray_cluster: str, tmp_path: Path) -> None:
    """Issue 28: examples/own-script/job.yaml as it is (only the executor chosen on the command line), its
    program on 2 Ray workers with torchrun's variables; the same file runs on the local executor
    (tests/launch/test_entrypoint.py)."""
    env = _cli_env(ray_cluster)
    job = REPO / "examples" / "own-script" / "job.yaml"
    submitted = run_cli(["submit", str(job), "--set", "cluster.executor=ray"], cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    run_dir = run_dir_of(submitted)
    status = wait_status(run_dir, env, lambda s: s["state"] in TERMINAL, 300, "the Ray job")
    assert status["state"] == "COMPLETED", f"{status}\n{log_tail(run_dir)}"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(40)), steps
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt")) == [
        f"step-{s}.pt" for s in (19, 29, 39, 9)]
    assert "finished 40 steps" in (run_dir / "logs" / "rank-0.attempt-0.log").read_text()
    assert "training finished" in (run_dir / "logs" / "ray-driver.log").read_text()

    local_env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    local_env.update(PATH=os.path.dirname(sys.executable), OMP_NUM_THREADS="1")
    local = run_cli(["submit", str(job), "--wait", "--timeout", "200"], cwd=tmp_path, env=local_env, timeout_s=260)
    assert local.returncode == 0 and "executor: local" in local.stderr, local.stdout + local.stderr
    ray_losses, local_losses = _losses(run_dir), _losses(run_dir_of(local))
    assert sorted(local_losses) == list(range(40))
    assert max(abs(ray_losses[s] - local_losses[s]) for s in ray_losses) <= 1e-6, (ray_losses, local_losses)
