"""The files `submit` writes into a run directory: the job files, the rendered script, the image recipe.

A run directory that cannot be written (a full disk, a quota, read-only) is the user's to fix: one
line naming the file and runs_dir, exit 2, instead of a traceback (`writing`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from hpctrain.errors import ConfigError
from hpctrain.launch import stages
from hpctrain.launch.rundir import write_json, write_text
from hpctrain.rundir.layout import JOB_FILE, PLAN_FILE, RESOLVED_FILE, SUBMIT_DIR

if TYPE_CHECKING:
    from hpctrain.config import Job

SCRIPT_NAME = "job.sbatch"
RECIPE_NAME = "recipe.def"


@contextmanager
def writing(run_dir: Path) -> Iterator[None]:
    """OSError while writing into run_dir -> ConfigError naming the file and runs_dir."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or run_dir
        raise ConfigError(f"runs_dir: cannot write {where} ({exc.strerror or exc}); free space there or set "
                          "runs_dir to a writable folder") from None


def write_job_files(run_dir: Path, job: Job, resolved: Job, plan: dict[str, Any]) -> None:
    """job.yaml (as submitted, after overrides), job.resolved.yaml and plan.json."""
    # Here, not at the top: `status` and `cancel` import this module (for `writing`) and never build the schema.
    from hpctrain.config import dump_job

    with writing(run_dir):
        write_text(run_dir / JOB_FILE, dump_job(job))
        write_text(run_dir / RESOLVED_FILE, dump_job(resolved))
        write_json(run_dir / PLAN_FILE, plan)


def write_script(run_dir: Path, resolved: Job, array: Optional[str] = None,
                 into: Optional[Path] = None) -> tuple[str, Path]:
    """(text, path) of submit/job.sbatch for the job in run_dir, rendered by the render stage, written under
    `into` (a dry run's scratch folder) or run_dir."""
    script = stages.render_script(resolved, run_dir, array=array)
    path = (into or run_dir) / SUBMIT_DIR / SCRIPT_NAME
    with writing(into or run_dir):
        write_text(path, script)
    return script, path


def write_recipe(run_dir: Path, resolved: Job, into: Optional[Path] = None) -> Path:
    path = (into or run_dir) / SUBMIT_DIR / RECIPE_NAME
    write_text(path, stages.render_recipe(resolved))
    return path
