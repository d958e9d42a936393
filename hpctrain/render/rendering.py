"""render_script, render_recipe, write_rendered: a job in, text or files out."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.errors import RenderError
from hpctrain.render.environment import RECIPE_TEMPLATE, SCRIPT_TEMPLATE, render_template, template_dir_for

if TYPE_CHECKING:
    from hpctrain.config import Job

SCRIPT_FILE = "job.sbatch"
RECIPE_FILE = "recipe.def"
RESOLVED_FILE = "job.resolved.yaml"


def _needs_planner(job: Job) -> bool:
    p = job.parallel
    autos = [p.tp, p.pp, p.dp, p.schedule, p.virtual_stages, p.zero, job.train.micro_batch,
             job.train.activation_checkpointing]
    return job.placement is None or "auto" in autos


def resolve(job: Job) -> Any:
    """The resolved job: the planner's (hpctrain.plan.resolve_job) when it is installed and needed.

    A job that already carries a placement and no `auto` is returned as is: no stage re-plans.
    Without the planner, tp, pp and dp must be explicit.
    """
    if job.model is None:  # an entrypoint without a model: nothing to plan
        from hpctrain.config.entrypoint import layout_without_model

        return layout_without_model(job)
    if not _needs_planner(job):
        return job
    try:
        from hpctrain.plan import resolve_job
    except ImportError:
        autos = [f"parallel.{k}" for k in ("tp", "pp", "dp") if getattr(job.parallel, k) == "auto"]
        if autos:
            raise RenderError([f"{name}: is 'auto', but this hpctrain has no planner (hpctrain.plan.resolve_job) "
                               f"to choose it (got 'auto'); set parallel.tp, parallel.pp and parallel.dp to "
                               f"numbers, e.g. --set {name}=1" for name in autos]) from None
        return job
    resolved, _plan = resolve_job(job)
    return resolved


def _script(resolved: Job, array: Optional[str], run_dir: str, template_dir: Optional[str]) -> str:
    from hpctrain.render.context import script_context

    context = script_context(resolved, run_dir=str(run_dir), array=array)
    return render_template(SCRIPT_TEMPLATE, context, template_dir_for(resolved, template_dir))


def _recipe(resolved: Job, template_dir: Optional[str]) -> str:
    from hpctrain.render.recipe import recipe_context

    return render_template(RECIPE_TEMPLATE, recipe_context(resolved), template_dir_for(resolved, template_dir))


def render_script(job: Job, *, array: Optional[str] = None, run_dir: str,
                  template_dir: Optional[str] = None) -> str:
    """The sbatch script for `job` (resolved first if it still has `auto` values).

    run_dir: the run directory on the cluster: the script reads <run_dir>/job.resolved.yaml and writes
    <run_dir>/slurm-%j.out. With `array` (an sbatch --array spec such as "0-7%4"), <run_dir> is the sweep
    folder: task N reads <run_dir>/tasks/N/job.resolved.yaml, runs in <run_dir>/tasks/N/ and logs to
    <run_dir>/tasks/N/slurm-%A_%a.out; those folders must exist before submission.
    """
    return _script(resolve(job), array, run_dir, template_dir)


def render_recipe(job: Job, *, template_dir: Optional[str] = None) -> str:
    """The Singularity/Apptainer definition file (recipe.def) for the job's image."""
    return _recipe(job, template_dir)


def write_rendered(job: Job, out_dir: str | Path, *, run_dir: Optional[str | Path] = None,
                   template_dir: Optional[str] = None) -> dict[str, Path]:
    """Resolve once, then write job.sbatch and recipe.def to out_dir and job.resolved.yaml to run_dir.

    run_dir defaults to out_dir (what `hpctrain render` does); the script reads
    <run_dir>/job.resolved.yaml. Returns {"script": ..., "recipe": ..., "resolved": ...}.
    """
    from hpctrain.config import dump_job

    resolved = resolve(job)
    out = Path(out_dir)
    run = Path(run_dir) if run_dir is not None else out
    texts = {"script": _script(resolved, None, str(run), template_dir), "recipe": _recipe(resolved, template_dir),
             "resolved": dump_job(resolved)}
    paths = {"script": out / SCRIPT_FILE, "recipe": out / RECIPE_FILE, "resolved": run / RESOLVED_FILE}
    from hpctrain.userfiles import writing_output

    for key, path in paths.items():
        with writing_output("--run-dir" if key == "resolved" and run_dir is not None else "-o",
                            run if key == "resolved" else out):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(texts[key], encoding="utf-8")
    with writing_output("-o", out):
        paths["script"].chmod(0o755)
    return paths
