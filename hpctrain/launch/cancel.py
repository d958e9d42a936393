"""`cancel`: stop a run (every task of a sweep) through the executor that started it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hpctrain.errors import ConfigError
from hpctrain.launch import rundir
from hpctrain.launch.slurm_commands import SlurmCommands
from hpctrain.launch.status import is_finished, run_status


def cancel_run(run_dir: Path, task_id: Optional[int] = None,
               commands: Optional[SlurmCommands] = None) -> tuple[str, Optional[str]]:
    """Cancel the run's current submission (or one task of a sweep).

    Returns (job id, None) when a cancel was sent, or (job id, final state) when the job had already ended.
    """
    sub = rundir.last_submission(run_dir)
    if not sub or not sub.get("job_id"):
        raise ConfigError(f"RUN: {run_dir} was never submitted (dry run or refused); nothing to cancel")
    job_id = str(sub["job_id"])
    if task_id is not None:
        if not rundir.is_sweep(run_dir):
            raise ConfigError(f"--task: {run_dir.name} is a single job, not a sweep; drop --task")
        job_id = f"{job_id}_{task_id}"
    status = run_status(run_dir, commands)
    if task_id is not None:
        status = next((t for t in status["tasks"] if t["task_id"] == task_id), {})
        if not status:
            raise ConfigError(f"--task: the sweep {run_dir.name} has no task {task_id}; see `hpctrain status {run_dir}`")
    if is_finished(status):
        return job_id, status["state"]
    if sub.get("executor") == "local":
        from hpctrain.launch import local_executor

        if task_id is not None:
            raise ConfigError("--task: the local executor cancels a whole sweep; drop --task")
        if not local_executor.cancel(job_id):
            return job_id, run_status(run_dir)["state"]
    elif sub.get("executor") == "volcano":
        from hpctrain.launch.kubectl import Kubectl

        if task_id is not None:
            raise ConfigError("--task: a volcano job is one Job, not a sweep; drop --task")
        Kubectl().delete(job_id)
    elif sub.get("executor") == "ray":
        from hpctrain.launch import ray_executor

        if task_id is not None:
            raise ConfigError("--task: a Ray run is a single job; drop --task")
        if not ray_executor.cancel(job_id, str(sub.get("address") or "")):
            return job_id, run_status(run_dir)["state"]
    else:
        (commands or SlurmCommands()).scancel(job_id)
    rundir.append_event(run_dir, "cancel_requested", job_id=job_id, executor=sub.get("executor"))
    return job_id, None
