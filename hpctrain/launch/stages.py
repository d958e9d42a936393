"""The launcher's calls into the other stages, in one place: plan (resolve), render, runtime command.

Launch never re-plans a resolved job and never writes a script itself: the planner fills the `auto`
values once, the render stage writes the sbatch script, and both executors start the same
runtime entry point.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

from hpctrain.config import Job
from hpctrain.render.context import RUNTIME_MODULE  # the one entry point both executors start



def resolve(job: Job) -> tuple[Job, dict[str, Any]]:
    """(resolved job, plan.json data). Raises PlanError (exit 2) when no layout fits."""
    from hpctrain.plan import resolve_job

    resolved, result = resolve_job(job)
    return resolved, result.to_json()


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
    """The full command of one rank of the job in run_dir."""
    return [*runtime_command(python), "--job", str(run_dir / "job.resolved.yaml"), "--run-dir", str(run_dir)]



def newest_complete_checkpoint(checkpoint_dir: Path) -> tuple[Optional[Path], list[str]]:
    """(the checkpoint the runtime will load next, rejected folders with reasons), by the checkpoint
    module's own rule (`hpctrain.runtime.checkpoint.scan`).

    That module imports torch, which the login path must not: it runs in a child process.
    """
    import subprocess

    code = ("import json, sys; from hpctrain.runtime.checkpoint import scan; s = scan(sys.argv[1]); "
            "print(json.dumps({'newest': s.newest[1] if s.newest else None, 'rejected': s.rejected}))")
    result = subprocess.run([sys.executable, "-c", code, str(checkpoint_dir)], capture_output=True, text=True,
                            timeout=120, check=False, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        from hpctrain.errors import HpctrainError

        raise HpctrainError(f"cannot scan checkpoints in {checkpoint_dir}: {result.stderr.strip()[-500:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    rejected = [f"{path}: {reason}" for path, reason in data["rejected"]]
    return (Path(data["newest"]) if data["newest"] else None), rejected
