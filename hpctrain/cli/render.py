"""CLI command of the render stage: `hpctrain render JOB.yaml [-o DIR] [--stdout] [--set ...]`."""

from __future__ import annotations

import argparse

from hpctrain.cli.options import add_set_option


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    render = subparsers.add_parser(
        "render", help="write the sbatch script, the container recipe and the resolved job (vcjob.yaml for volcano)",
        description="Resolve the job (the planner fills every 'auto'), then write job.sbatch, recipe.def and "
                    "job.resolved.yaml to DIR and print their paths. Every job.yaml value is quoted data in "
                    "the script; only slurm.setup lines are shell.")
    render.add_argument("job", metavar="JOB.yaml", help="the job file to render")
    render.add_argument("-o", "--output-dir", metavar="DIR",
                        help="folder for the files (default: <runs_dir>/<name>-rendered)")
    render.add_argument("--run-dir", metavar="DIR",
                        help="run directory the script uses on the cluster (default: the output folder)")
    render.add_argument("--template-dir", metavar="DIR",
                        help="folder of templates overriding the shipped ones (job.sbatch.j2, recipe.def.j2, "
                             "partials); also $HPCTRAIN_TEMPLATE_DIR")
    render.add_argument("--stdout", action="store_true", help="print the script only; write nothing")
    add_set_option(render)
    render.set_defaults(handler=run_render)


def run_render(args: argparse.Namespace) -> int:
    import os

    from hpctrain.config import load_job
    from hpctrain.render.artefacts import artefact_for
    from hpctrain.render.quoting import slurm_job_name

    job = load_job(args.job, args.overrides)
    out_dir = args.output_dir or os.path.join(job.runs_dir, f"{slurm_job_name(job.name)}-rendered")
    artefact = artefact_for(job)  # the sbatch script and recipe, or a volcano Job's vcjob.yaml
    if args.stdout:
        print(artefact.text(job, args.run_dir, out_dir, args.template_dir), end="")
        return 0
    for path in artefact.files(job, out_dir, args.run_dir, args.template_dir).values():
        print(path)
    return 0
