"""`submit`: job -> resolved job -> run directory -> rendered script -> one executor call.

The two executors differ by one attribute (`Submission.executor`): Slurm gets the rendered script
through submitit, the local executor starts the same runtime as local processes.
"""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from hpctrain.config import Job, dump_job
from hpctrain.config.data_files import check_data
from hpctrain.errors import ConfigError, SubmissionError
from hpctrain.launch import stages
from hpctrain.launch.rundir import append_event, create_run_dir, write_json, write_text
from hpctrain.launch.slurm_commands import SlurmCommands, missing_program_error, sbatch_available
from hpctrain.rundir.layout import JOB_FILE, PLAN_FILE, RESOLVED_FILE, SUBMIT_DIR

SCRIPT_NAME = "job.sbatch"
RECIPE_NAME = "recipe.def"


@dataclass
class Submission:
    """What a submit (or sweep) did: where, with which executor, under which job id."""

    run_dir: Path
    executor: str
    executor_note: str
    job_id: Optional[str] = None  # None for --dry-run
    script_path: Optional[Path] = None
    recipe_path: Optional[Path] = None  # written by --dry-run: the image recipe a container job would use
    array: Optional[str] = None
    process: Optional[subprocess.Popen[bytes]] = field(default=None, repr=False)  # local supervisor


def choose_executor(job: Job, env: Optional[dict[str, str]] = None, *, dry_run: bool = False) -> tuple[str, str]:
    """("slurm" | "local", a sentence saying which and why).

    A dry run submits nothing, so it never needs sbatch: executor slurm renders without it.
    """
    kind = job.cluster.executor
    sbatch = sbatch_available(env)
    if kind == "auto":
        if sbatch:
            return "slurm", f"executor: slurm (cluster.executor auto, sbatch found at {sbatch})"
        return "local", "executor: local (cluster.executor auto, no sbatch on PATH)"
    if kind == "ray":
        from hpctrain.launch.ray_executor import address_of

        return kind, f"executor: ray (cluster.executor; Ray Jobs API at {address_of(job, env)})"
    if kind == "slurm" and sbatch is None:
        if dry_run:
            return kind, "executor: slurm (cluster.executor; dry run: no sbatch on PATH, none needed)"
        raise missing_program_error("sbatch")
    return kind, f"executor: {kind} (cluster.executor)"


def check_local(job: Job) -> None:
    """The local and Ray executors start the ranks on the host (no Singularity image)."""
    if job.container.image is not None and job.cluster.executor == "ray":
        raise ConfigError(f"container.image: the ray executor runs the ranks in the Ray workers' environment, "
                          f"not in an image (got {job.container.image!r}); unset container.image (a Ray cluster "
                          "brings its own image) or use cluster.executor: slurm")
    if job.container.image is not None:
        raise ConfigError(f"container.image: the local executor runs on the host, not in an image (got "
                          f"{job.container.image!r}); unset container.image or use cluster.executor: slurm")


@contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """A run directory that cannot be written (a full disk, a quota, read-only) is the user's to fix: one line
    naming the file and runs_dir, exit 2, instead of a traceback."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or run_dir
        raise ConfigError(f"runs_dir: cannot write {where} ({exc.strerror or exc}); free space there or set "
                          "runs_dir to a writable folder") from None


def write_job_files(run_dir: Path, job: Job, resolved: Job, plan: dict[str, Any]) -> None:
    """job.yaml (as submitted, after overrides), job.resolved.yaml and plan.json."""
    with writing(run_dir):
        _write_job_files(run_dir, job, resolved, plan)


def _write_job_files(run_dir: Path, job: Job, resolved: Job, plan: dict[str, Any]) -> None:
    write_text(run_dir / JOB_FILE, dump_job(job))
    write_text(run_dir / RESOLVED_FILE, dump_job(resolved))
    write_json(run_dir / PLAN_FILE, plan)


def write_script(run_dir: Path, resolved: Job, array: Optional[str] = None) -> tuple[str, Path]:
    script = stages.render_script(resolved, run_dir, array=array)
    path = run_dir / SUBMIT_DIR / SCRIPT_NAME
    with writing(run_dir):
        write_text(path, script)
    return script, path


def write_recipe(run_dir: Path, resolved: Job) -> Path:
    path = run_dir / SUBMIT_DIR / RECIPE_NAME
    write_text(path, stages.render_recipe(resolved))
    return path


def submit_job(job: Job, *, dry_run: bool = False, commands: Optional[SlurmCommands] = None) -> Submission:
    """Resolve, create the run directory, render and submit one job."""
    kind, note = choose_executor(job, commands.env if commands else None, dry_run=dry_run)
    if kind in ("local", "ray"):
        check_local(job)
    resolved, plan = stages.resolve(job)
    if not dry_run and kind != "volcano":  # a volcano job's paths are the pods' (on kubernetes.pvc), not ours
        # a dry run may render for a cluster whose file system this machine does not see
        check_data(resolved)  # before the run directory exists: a bad token file submits nothing
        if job.checkpoint.dir:  # a new run owns nothing: another run's checkpoints are refused here
            stages.check_checkpoint_dir(Path(job.checkpoint.dir), None, job.checkpoint.adopt)
    run_dir = create_run_dir(job.runs_dir, job.name)
    write_job_files(run_dir, job, resolved, plan)
    return launch(run_dir, resolved, kind, note, [(None, run_dir, resolved)], dry_run=dry_run, commands=commands)


# (array task id or None for a plain job, its run directory, its resolved job)
TaskSpec = tuple[Optional[int], Path, Job]


def launch(run_dir: Path, resolved: Job, kind: str, note: str, tasks: list[TaskSpec], *,
           array: Optional[str] = None, max_parallel: int = 1, dry_run: bool = False,
           commands: Optional[SlurmCommands] = None, event: str = "submitted") -> Submission:
    """Submit a prepared run directory (a job, or a sweep's tasks) with the chosen executor.

    `resolved` is the job the sbatch script is rendered from (for a sweep, its first point).
    """
    out = Submission(run_dir, kind, note, array=array)
    if kind == "volcano":
        from hpctrain.launch.volcano_submit import launch_volcano

        return launch_volcano(out, resolved, array=array, dry_run=dry_run)
    extra: dict[str, Any] = {}  # executor facts later commands need (the Ray address)
    if kind == "slurm" or dry_run:  # a dry run shows what Slurm would get whatever the executor
        script, out.script_path = write_script(run_dir, resolved, array)
    if dry_run:
        out.recipe_path = write_recipe(run_dir, resolved)
        append_event(run_dir, "dry_run", executor=kind)
        return out
    try:
        if kind == "slurm":
            from hpctrain.launch.slurm_executor import RenderedSlurmExecutor

            executor = RenderedSlurmExecutor(run_dir / SUBMIT_DIR, script, commands or SlurmCommands())
            out.job_id = executor.submit_rendered()
        elif kind == "ray":
            from hpctrain.launch import ray_executor
            from hpctrain.render.context import rank_python

            out.job_id, address = ray_executor.submit(run_dir, resolved, rank_python(resolved))
            extra["address"] = address
        else:
            from hpctrain.launch.local_executor import LocalExecutor

            out.job_id, out.process = LocalExecutor().submit(run_dir, tasks, max_parallel)
    except SubmissionError as exc:
        append_event(run_dir, "failed", reason=str(exc), stage="submit", executor=kind)
        raise SubmissionError(f"{exc}\n(run directory {run_dir} marked failed)") from None
    append_event(run_dir, event, executor=kind, job_id=out.job_id, array=array, **extra)
    for task_id, task_dir, _ in tasks:
        if task_id is not None:
            append_event(task_dir, event, executor=kind, job_id=f"{out.job_id}_{task_id}", task_id=task_id)
    return out
