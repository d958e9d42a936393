"""`submit`: job -> resolved job -> run directory -> prepared files -> one `Executor.submit`.

Which executor runs the job is `hpctrain.launch.executor.choose`'s answer (cluster.executor, or for
`auto` slurm when sbatch is on PATH, else local); every backend (local, slurm, ray, volcano) is
called through the same interface, so nothing here depends on which one it is.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hpctrain.config import Job
from hpctrain.config.data_files import check_data
from hpctrain.errors import SubmissionError
from hpctrain.launch import stages
from hpctrain.launch.executor import Executor, SubmitRefused, TaskSpec, choose
from hpctrain.launch.files import RECIPE_NAME, SCRIPT_NAME, write_job_files, write_recipe, write_script, writing
from hpctrain.launch.rundir import append_event, create_run_dir
from hpctrain.rundir.events import DRY_RUN, FAILED, SUBMITTED

__all__ = ["RECIPE_NAME", "SCRIPT_NAME", "Submission", "TaskSpec", "launch", "submit_job", "write_job_files",
           "write_recipe", "write_script", "writing"]


@dataclass
class Submission:
    """What a submit (or sweep) did: where, with which executor, under which job id."""

    run_dir: Path
    executor: str
    executor_note: str
    job_id: Optional[str] = None  # None for --dry-run
    script_path: Optional[Path] = None  # the file the scheduler gets (a dry run's "script" or "manifest")
    recipe_path: Optional[Path] = None  # written by --dry-run: the image recipe a container job would use
    array: Optional[str] = None
    process: Optional[subprocess.Popen[bytes]] = field(default=None, repr=False)  # local supervisor
    artefact: str = "script"  # what script_path is, in the dry run's words (Executor.artefact)
    scratch: Optional[Path] = None  # `resume --dry-run`: where the new job files went (the run is untouched)
    changes: list[str] = field(default_factory=list)  # `resume --dry-run`: "key: old -> new" of the resolved job


def submit_job(job: Job, *, dry_run: bool = False, env: Optional[Mapping[str, str]] = None) -> Submission:
    """Resolve, create the run directory, render and submit one job."""
    executor, note = choose(job, env, dry_run=dry_run)
    executor.check(job)
    resolved, plan = stages.resolve(job)
    if executor.sees_paths(dry_run=dry_run):
        # before the run directory exists: a missing or bad token file submits nothing (a dry run says so too;
        # one that renders for a cluster whose file system this machine does not see is not checked)
        check_data(resolved)
        if not dry_run and job.checkpoint.dir:  # a new run owns nothing: another run's checkpoints are refused
            stages.check_checkpoint_dir(Path(job.checkpoint.dir), None, job.checkpoint.adopt)
    run_dir = create_run_dir(job.runs_dir, job.name)
    write_job_files(run_dir, job, resolved, plan)
    return launch(run_dir, resolved, executor, note, [(None, run_dir, resolved)], dry_run=dry_run)


def launch(run_dir: Path, resolved: Job, executor: Executor, note: str, tasks: list[TaskSpec], *,
           array: Optional[str] = None, max_parallel: int = 1, dry_run: bool = False,
           event: str = SUBMITTED) -> Submission:
    """Submit a prepared run directory (a job, or a sweep's tasks) with `executor`.

    `resolved` is the job the script is rendered from (for a sweep, its first point).
    """
    name = executor.name
    out = Submission(run_dir, name, note, array=array, artefact=executor.artefact)
    prepared = executor.prepare(run_dir, resolved, array=array, dry_run=dry_run)
    out.script_path, out.recipe_path = prepared.script_path, prepared.recipe_path
    if dry_run:
        append_event(run_dir, DRY_RUN, executor=name)
        return out
    try:
        handle = executor.submit(run_dir, resolved, tasks, prepared, array=array, max_parallel=max_parallel)
    except SubmitRefused as refused:
        append_event(run_dir, FAILED, reason=refused.reason, stage="submit", executor=name)
        raise refused.error from None
    except SubmissionError as exc:
        append_event(run_dir, FAILED, reason=str(exc), stage="submit", executor=name)
        raise SubmissionError(f"{exc}\n(run directory {run_dir} marked failed)") from None
    out.job_id, out.process = handle.job_id, handle.process
    append_event(run_dir, event, executor=name, job_id=out.job_id, array=array, **handle.facts)
    for task_id, task_dir, _ in tasks:
        if task_id is not None:
            append_event(task_dir, event, executor=name, job_id=f"{out.job_id}_{task_id}", task_id=task_id)
    return out
