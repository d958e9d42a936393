"""Checkpoint/restart under faults on the real local Slurm (issue 7 acceptance).

- bench/chaos.py: a 4-rank tp2 x dp2 job over 2 nodes, 120 steps, through a seeded schedule of
  `scontrol requeue`, preemption by the `high` partition, SIGKILL of one rank and a time limit brought
  near (signal path); it must finish on its own with every step once and the uninterrupted run's
  losses bit for bit, and `hpctrain status` must count the 4 restarts.
- A 3-task array whose task 1 gets the signal: only task 1 is requeued (ARRAYJOBID_TASKID).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "hpctrain"]


def _cli(args: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)


def _wait(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


@pytest.mark.timeout(480)
def test_chaos_schedule_keeps_the_loss_curve_bit_identical(slurm_cluster: Any, tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    env = {**slurm_cluster.client_env(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--seed", "7", "--json", str(out),
                           "--work", str(tmp_path / "work")], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=450)
    assert proc.returncode == 0 and out.exists(), f"{proc.stdout}\n{proc.stderr}"
    result = json.loads(out.read_text())
    report = f"{proc.stdout}\n{json.dumps(result, indent=1)[:4000]}"
    assert sorted(f["fault"] for f in result["faults"]) == ["kill-rank", "preempt", "requeue", "time-limit"], report
    assert result["checks"] == {"completed": True, "steps_once": True, "curve_bit_identical": True,
                                "status_restarts": True, "reference_ok": True}, report
    # How each attempt ended, as the run recorded it: the rank crash and the two signal paths
    # (preemption, time limit) requeued by the batch script; the outside requeue stopped the ranks with TERM.
    reasons = [tuple(e[1:]) for e in result["events"]]  # (attempt, event, reason or signal) -> (event, ...)
    assert reasons.count(("requeued", "rank-crashed")) == 1, report
    assert reasons.count(("requeued", "runtime-requested")) >= 2, report
    assert reasons.count(("signal", "USR2")) >= 2 and ("signal", "TERM") in reasons, report
    status = _cli(["status", result["run_dir"], "--json"], env, tmp_path)
    history = [e["event"] for e in json.loads(status.stdout)["history"]]
    assert history.count("started") == 5 and "resumed" in history and "requeue requested" in history, history


ARRAY_JOB = {
    "name": "array",
    "model": {"preset": "tiny", "layers": 2, "seq_len": 32},
    "train": {"global_batch": 4, "micro_batch": 2, "steps": 24, "precision": "fp32",
              "activation_checkpointing": "none", "log_every": 1, "lr_schedule": {"warmup_steps": 0}},
    "parallel": {"tp": 1, "pp": 1},
    "cluster": {"executor": "slurm", "nodes": 1, "gpus_per_node": 1, "gpu": "a100-80gb"},
    "runtime": {"allow_cpu": True},  # the test cluster's GPUs are device files; the ranks train on the CPU
    "slurm": {"partition": "low", "time": "00:10:00", "exclusive": False, "max_requeues": 2},
    "checkpoint": {"every_steps": 1000},
}


@pytest.mark.timeout(300)
def test_requeueing_array_task_1_restarts_only_task_1(slurm_cluster: Any, tmp_path: Path) -> None:
    env = {**slurm_cluster.client_env(), "PYTHONPATH": str(REPO), "HPCTRAIN_TEST_STEP_DELAY_S": "0.25"}
    (tmp_path / "array.yaml").write_text(yaml.safe_dump(ARRAY_JOB))
    sweep = _cli(["sweep", "array.yaml", "--grid", "train.seed=1,2,3", "--max-parallel", "3"], env, tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    run_dir = Path(re.search(r"^run (.+)$", sweep.stdout, re.M).group(1))  # type: ignore[union-attr]
    array_id = re.search(r"^job (\S+)$", sweep.stdout, re.M).group(1)  # type: ignore[union-attr]
    task1 = run_dir / "tasks" / "1"

    def steps_logged() -> int:
        try:
            return len((task1 / "metrics.jsonl").read_text().splitlines())
        except OSError:
            return 0
    _wait(lambda: steps_logged() >= 3, 120, "task 1 to log 3 steps")
    slurm_cluster.run(["scancel", "--signal=USR2", f"{array_id}_1"])  # to its ranks, as at preemption

    def ended() -> Any:
        status = json.loads(_cli(["status", str(run_dir), "--json"], env, tmp_path).stdout)
        states = [t["state"] for t in status["tasks"]]
        return status if all(s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") for s in states) else None
    status = _wait(ended, 200, "the 3 tasks to end")
    tasks = status["tasks"]
    assert [t["state"] for t in tasks] == ["COMPLETED"] * 3, tasks
    assert [t["restarts"] for t in tasks] == [0, 1, 0], tasks
    assert [slurm_cluster.job_info(f"{array_id}_{i}")["Restarts"] for i in range(3)] == ["0", "1", "0"]
    events = [json.loads(line) for line in (task1 / "events.jsonl").read_text().splitlines()]
    requeued = [e for e in events if e["event"] == "requeued"]
    assert [(e["job_id"], e["reason"]) for e in requeued] == [(f"{array_id}_1", "runtime-requested")], events
    assert [json.loads(m)["step"] for m in (task1 / "metrics.jsonl").read_text().splitlines()] == list(range(1, 25))
    for other in (0, 2):  # untouched: one attempt, no requeue
        other_events = (run_dir / "tasks" / str(other) / "events.jsonl").read_text()
        assert '"requeued"' not in other_events and '"attempt":1' not in other_events
