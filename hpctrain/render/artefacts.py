"""Which files `hpctrain render` writes for a job: the sbatch script and recipe, or a Volcano Job's manifest.

The render stage owns its artefacts; this table says which one a job's cluster.executor submits
(every executor but volcano runs the sbatch script, or shows it on a dry run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from hpctrain.render.rendering import render_script, write_rendered
from hpctrain.render.vcjob import render_vcjob, write_vcjob

if TYPE_CHECKING:
    from hpctrain.config import Job


@dataclass(frozen=True)
class Artefact:
    """Text for --stdout, files for -o DIR. `run_dir`: where the job runs (None: the artefact's default)."""

    text: Callable[[Any, Optional[str], str, Optional[str]], str]  # (job, run_dir, out_dir, template_dir)
    files: Callable[[Any, str, Optional[str], Optional[str]], dict[str, Path]]  # (job, out_dir, run_dir, template_dir)


SBATCH = Artefact(
    text=lambda job, run_dir, out_dir, template_dir: render_script(job, run_dir=run_dir or out_dir,
                                                                   template_dir=template_dir),
    files=lambda job, out_dir, run_dir, template_dir: write_rendered(job, out_dir, run_dir=run_dir,
                                                                     template_dir=template_dir))
VCJOB = Artefact(  # the manifest has no templates: --template-dir does not apply
    text=lambda job, run_dir, out_dir, template_dir: render_vcjob(job, run_dir=run_dir),
    files=lambda job, out_dir, run_dir, template_dir: write_vcjob(job, out_dir, run_dir=run_dir))

BY_EXECUTOR: dict[str, Artefact] = {"volcano": VCJOB}


def artefact_for(job: Job) -> Artefact:
    """What the job's cluster.executor submits (the sbatch script unless listed in BY_EXECUTOR)."""
    return BY_EXECUTOR.get(str(job.cluster.executor), SBATCH)
