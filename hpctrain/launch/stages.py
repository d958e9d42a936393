"""The launcher's calls into the other stages, in one place: plan (resolve), render, runtime command.

Launch never re-plans a resolved job and never writes a script itself: the planner fills the `auto`
values once, the render stage writes the sbatch script, and every executor starts the same
runtime entry point.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.render.context import RUNTIME_MODULE, rank_module  # the entry point every executor starts
from hpctrain.rundir.layout import RESOLVED_FILE

if TYPE_CHECKING:  # annotations only (`status` imports this module through the local executor)
    from hpctrain.config import Job


def resolve(job: Job) -> tuple[Job, dict[str, Any]]:
    """(resolved job, plan.json data). Raises PlanError (exit 2) when no layout fits. An entrypoint job
    without `model:` is not planned (config/entrypoint.py layout_without_model)."""
    if job.model is None:
        from hpctrain.config.entrypoint import layout_without_model

        resolved = layout_without_model(job)
        p = resolved.parallel
        return resolved, {"planned": False, "tp": p.tp, "pp": p.pp, "dp": p.dp,
                          "note": "no model: nothing to plan; the entrypoint gets the fixed degrees"}
    from hpctrain.plan import resolve_job

    resolved, result = resolve_job(job)
    check_node_range(job)
    return resolved, result.to_json()


def check_node_range(job: Job) -> None:
    """An elastic job is planned at submit for every count of its range, so that a start on any of them
    finds a layout (the batch script re-plans for the count it got): PlanError naming the count if not."""
    from hpctrain.errors import PlanError
    from hpctrain.plan import plan_job

    if not job.cluster.elastic:
        return
    for nodes in job.cluster.node_counts:
        if nodes == job.cluster.nodes:
            continue  # planned above
        try:
            plan_job(job.model_copy(update={"cluster": job.cluster.model_copy(update={"nodes": nodes})}))
        except PlanError as exc:
            raise PlanError(f"cluster.nodes {job.cluster.nodes_spec}: no layout fits {nodes} node(s): {exc}") from None


def render_script(job: Job, run_dir: Path, array: Optional[str] = None) -> str:
    """The sbatch script text for a resolved job (`array`: an sbatch --array spec for sweeps)."""
    from hpctrain import render

    return render.render_script(job, array=array, run_dir=str(run_dir))


def render_recipe(job: Job) -> str:
    """The Singularity/Apptainer recipe for the job's image."""
    from hpctrain import render

    return render.render_recipe(job)


def runtime_command(python: Optional[str] = None) -> list[str]:
    """The runtime entry point each local rank runs (the sbatch script runs the same module under srun)."""
    return [python or sys.executable, "-u", "-m", RUNTIME_MODULE]


def runtime_argv(run_dir: Path, python: Optional[str] = None) -> list[str]:
    """The full command of one rank of the built-in runtime for the job in run_dir."""
    return [*runtime_command(python), "--job", str(run_dir / RESOLVED_FILE), "--run-dir", str(run_dir)]


def rank_argv(run_dir: Path, job: Job, python: Optional[str] = None) -> list[str]:
    """The full command of one rank of `job` in run_dir, on every executor: the built-in runtime, or
    (`entrypoint:`) launch/entrypoint.py, which runs the user's program with torchrun's variables."""
    return [python or sys.executable, "-u", "-m", rank_module(job), "--job", str(run_dir / RESOLVED_FILE),
            "--run-dir", str(run_dir)]



def newest_complete_checkpoint(checkpoint_dir: Path) -> tuple[Optional[Path], list[str]]:
    """(the checkpoint the runtime will load next, rejected folders with reasons), by the rule the
    runtime uses (hpctrain.rundir.checkpoints.scan, torch-free). The login path runs the cheap checks
    (metadata checksum, every file present with its size); the ranks also hash the contents and fall
    back to an older checkpoint if one is damaged."""
    from hpctrain.rundir.checkpoints import scan

    found = scan(str(checkpoint_dir))
    rejected = [f"{path}: {reason}" for path, reason in found.rejected]
    return (Path(found.newest[1]) if found.newest else None), rejected


def check_checkpoint_dir(checkpoint_dir: Path, run_dir: Optional[Path], adopt: bool, probe: bool = True) -> None:
    """ConfigError (exit 2, at submit or resume rather than at the first save) when the checkpoint
    directory cannot be written or holds another run's checkpoints (`run_dir` None: a new run, which
    owns nothing yet) and `checkpoint.adopt` is not set. `probe` False (a dry run, which writes nothing
    into a run): the ownership check only, without the write probe."""
    from hpctrain.errors import ConfigError
    from hpctrain.rundir.checkpoints import InvalidCheckpoint, foreign_owner, ownership_error, run_identity
    from hpctrain.rundir.checkpoints import writable_problem

    problem = writable_problem(str(checkpoint_dir)) if probe else None
    if problem:
        raise ConfigError(f"checkpoint.dir {checkpoint_dir}: {problem}; the run could not save a checkpoint: "
                          "choose a writable checkpoint.dir")
    try:
        run_id = run_identity(str(run_dir)) if run_dir is not None else ""
    except (OSError, InvalidCheckpoint) as exc:
        raise ConfigError(f"RUN: {run_dir}: cannot read its run id ({exc})") from None
    other = foreign_owner(str(checkpoint_dir), run_id, str(run_dir) if run_dir is not None else None)
    if other is not None and not adopt:
        raise ConfigError(ownership_error(str(checkpoint_dir), other))


def check_sweep_checkpoint_dirs(points: list[tuple[str, Job]]) -> None:
    """Each task of a sweep is a run of its own: tasks that share a checkpoint.dir would resume and prune
    each other's checkpoints (checkpoint.adopt does not make that right). `points`: (label, job)."""
    import os

    from hpctrain.errors import ConfigError

    by_dir: dict[str, list[str]] = {}
    for label, job in points:
        if job.checkpoint.dir:
            by_dir.setdefault(os.path.abspath(job.checkpoint.dir), []).append(label)
    for folder, labels in by_dir.items():
        if len(labels) > 1:
            raise ConfigError(f"checkpoint.dir {folder}: shared by {len(labels)} points of the sweep ({labels[0]}; "
                              f"{labels[1]}{'; ...' if len(labels) > 2 else ''}); a checkpoint folder belongs to one "
                              "run: leave checkpoint.dir unset (each task then uses tasks/<i>/checkpoints) or sweep it")
    for label, job in points:
        if job.checkpoint.dir:
            check_checkpoint_dir(Path(job.checkpoint.dir), None, job.checkpoint.adopt)
