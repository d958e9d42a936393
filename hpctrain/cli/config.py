"""CLI commands of the config stage: `validate` and `schema`."""

from __future__ import annotations

import argparse

from hpctrain.cli.options import add_set_option

TYPE_CHECKING = False  # the constant mypy understands, without importing typing on the login path
if TYPE_CHECKING:
    from hpctrain.config import Job


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    validate = subparsers.add_parser("validate", help="check job.yaml files against the schema",
                                     description="Exit 0 when every file is valid; else print one line per "
                                                 "problem (FILE:LINE: field: what; fix) and exit 2.")
    validate.add_argument("files", nargs="+", metavar="JOB.yaml", help="one or more job files to check")
    add_set_option(validate)
    validate.set_defaults(handler=run_validate, exit_now=True)  # it only prints: cli/main.py ends it at once

    schema = subparsers.add_parser("schema", help="print the JSON Schema of job.yaml",
                                   description="Save it and point your editor at it: put "
                                               "`# yaml-language-server: $schema=job.schema.json` on the first "
                                               "line of job.yaml (VS Code YAML extension, Neovim yamlls, ...).")
    schema.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    schema.set_defaults(handler=run_schema)


def run_validate(args: argparse.Namespace) -> int:
    from hpctrain.config.loader import load_job_with_source, locate_problem
    from hpctrain.errors import ConfigError

    problems: list[str] = []
    for path in args.files:
        try:
            job, source = load_job_with_source(path, args.overrides)
            found = [locate_problem(line, source) for line in _catalog_problems(job)]
            found += [locate_problem(line, source) for line in _render_problems(job)]
            if not found and job.model is not None and job.model.init_from is not None:
                # init_from's safetensors headers (config/hf_weights_check.py), when config.json is fine
                from hpctrain.config.hf_weights_check import weights_problems

                found += [locate_problem(line, source) for line in weights_problems(job.model)]
            if job.sweep is not None:  # the grid as `hpctrain sweep` reads it (config/grid.py)
                from hpctrain.config.grid import grid_problems

                found += grid_problems(job, job.sweep.grid, source)
        except ConfigError as exc:
            found = exc.problems
        problems += found
        if not found:
            print(f"{path}: valid (job {job.name!r}, {job.cluster.nodes} node(s) x {job.cluster.gpus_per_node} GPUs)")
    if problems:
        raise ConfigError(problems)
    return 0


def _render_problems(job: Job) -> list[str]:
    """What render would refuse in the #SBATCH lines and the container binds (render/sbatch.py's checks)."""
    from hpctrain.render.sbatch import sbatch_problems

    return sbatch_problems(job)


def _catalog_problems(job: Job) -> list[str]:
    """GPU, node and fabric names must exist in the planner's hardware catalog (with did-you-mean)."""
    from hpctrain.plan.hardware import check_catalog_names, precision_problems

    return list(check_catalog_names(job)) + precision_problems(job)


def run_schema(args: argparse.Namespace) -> int:
    import json

    from hpctrain.config import json_schema

    text = json.dumps(json_schema(), indent=2) + "\n"
    if args.output:
        from hpctrain.userfiles import writing_output

        with writing_output("-o", args.output), open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(args.output)
    else:
        print(text, end="")
    return 0
