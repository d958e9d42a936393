"""`cancel`: stop a run (every task of a sweep) through the executor that started it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from hpctrain.errors import ConfigError
from hpctrain.launch import rundir
from hpctrain.launch.executor import executor_of
from hpctrain.launch.status import aggregate
from hpctrain.rundir.events import CANCEL_REQUESTED
from hpctrain.rundir.sweep_file import read_sweep


def cancel_run(run_dir: Path, task_id: Optional[int] = None,
               env: Optional[Mapping[str, str]] = None) -> tuple[str, Optional[str]]:
    """Cancel the run's current submission (or one task of a sweep).

    Returns (job id, None) when a cancel was sent, or (job id, final state) when the job had already ended.
    Only the executor's state is asked (not the run's metrics or history).
    """
    sub = rundir.last_submission(run_dir)
    if not sub or not sub.get("job_id"):
        raise ConfigError(f"RUN: {run_dir} was never submitted (dry run or refused); nothing to cancel")
    job_id = str(sub["job_id"])
    if task_id is not None:
        if not rundir.is_sweep(run_dir):
            raise ConfigError(f"--task: {run_dir.name} is a single job, not a sweep; drop --task")
        job_id = f"{job_id}_{task_id}"
    jobs = [(job_id, run_dir)]
    if rundir.is_sweep(run_dir):
        tasks = [(entry["task_id"], run_dir / entry["run_dir"]) for entry in read_sweep(run_dir).get("tasks", [])]
        if task_id is not None and task_id not in [t for t, _ in tasks]:
            raise ConfigError(f"--task: the sweep {run_dir.name} has no task {task_id}; "
                              f"see `hpctrain status {run_dir}`")
        jobs = [(f"{sub['job_id']}_{t}", path) for t, path in tasks if task_id is None or t == task_id]
    executor = executor_of(sub, env)

    def states() -> list[str]:
        return [s.state for s in executor.state(sub, jobs).values()]

    now = states()
    if now and not any(state in executor.active_states or state == "UNKNOWN" for state in now):
        return job_id, aggregate(now)  # every job (task) has ended
    if not executor.cancel(sub, job_id, task_id):
        return job_id, aggregate(states())
    rundir.append_event(run_dir, CANCEL_REQUESTED, job_id=job_id, executor=sub.get("executor"))
    return job_id, None
