"""`sweep`: expand a grid, drop infeasible points with the planner's reason, submit ONE job array.

    runs/<name>-<stamp>/sweep.json         the grid, the points, the skipped ones, the array job id
    runs/<name>-<stamp>/submit/job.sbatch  one script, --array=0-N%K
    runs/<name>-<stamp>/tasks/<i>/         one run directory per feasible point (its own resolved job)
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from hpctrain.config import Job, job_from_dict
from hpctrain.config.data_files import data_problems
from hpctrain.config.grid import base_data, check_grid, point_overrides
from hpctrain.config.overrides import parse_override
from hpctrain.config.paths import grid_path
from hpctrain.errors import ConfigError
from hpctrain.launch import stages
from hpctrain.launch.executor import TaskSpec, choose
from hpctrain.launch.files import write_job_files
from hpctrain.launch.rundir import SWEEP_FILE, TASKS_DIR, create_run_dir, init_run_dir, write_json
from hpctrain.launch.submit import Submission, launch


def parse_grid_option(text: str) -> tuple[str, list[Any]]:
    """`parallel.tp=1,2,4` -> ("parallel.tp", [1, 2, 4]); values are YAML scalars like --set."""
    path, value = parse_override(text)
    key = ".".join(path)
    raw = text.partition("=")[2]
    if isinstance(value, list):
        values = value
    else:
        values = [parse_override(f"{key}={part}")[1] for part in raw.split(",")]
    if not values or any(v == "" for v in values):
        raise ConfigError(f"--grid {text}: (grid): expected KEY=V1,V2,... with non-empty values (got {text!r}); "
                          "e.g. --grid parallel.tp=1,2,4")
    return key, values


def grid_of(job: Job, grid_options: Sequence[str]) -> dict[str, list[Any]]:
    """The sweep section's grid, with --grid options added (or replacing a key)."""
    grid: dict[str, list[Any]] = dict(job.sweep.grid) if job.sweep else {}
    for text in grid_options:
        key, values = parse_grid_option(text)
        grid[key] = [grid_path(tuple(key.split(".")), v, os.getcwd()) for v in values]  # typed here: from here
    if not grid:
        raise ConfigError("sweep: no grid; add a `sweep: grid:` section to the job or pass --grid KEY=V1,V2,...")
    for key, values in grid.items():
        if not values:
            raise ConfigError(f"sweep.grid.{key}: empty list of values; give at least one value")
    check_grid(job, grid)  # the same check as `hpctrain validate`: a typo is refused, not skipped
    return grid


def expand_grid(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination, the last key varying fastest: {a: [1, 2], b: [x]} -> [{a: 1, b: x}, {a: 2, b: x}]."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def point_label(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in point.items())


def resolve_points(job: Job, points: list[dict[str, Any]]) -> tuple[list[tuple[dict[str, Any], Job, Job, dict[str, Any]]],
                                                                  list[dict[str, Any]]]:
    """(feasible: [(point, job, resolved, plan)], skipped: [{point, reason}])."""
    base = base_data(job)
    feasible, skipped = [], []
    for point in points:
        overrides = point_overrides(point)
        try:
            point_job = job_from_dict(base, overrides, origin=job.name)
            resolved, plan = stages.resolve(point_job)
        except ConfigError as exc:  # PlanError is a ConfigError: the planner's reason
            skipped.append({"point": point, "reason": str(exc)})
            continue
        feasible.append((point, point_job, resolved, plan))
    return feasible, skipped


def submit_sweep(job: Job, grid_options: Sequence[str] = (), *, max_parallel: Optional[int] = None,
                 dry_run: bool = False, env: Optional[Mapping[str, str]] = None) -> tuple[Submission, dict[str, Any]]:
    """Expand, resolve every point, write the task run dirs and submit one array. Returns (submission, sweep.json)."""
    executor, note = choose(job, env, dry_run=dry_run)
    executor.check(job)
    grid = grid_of(job, grid_options)
    feasible, skipped = resolve_points(job, expand_grid(grid))
    if not feasible:
        raise ConfigError([f"sweep: no feasible point in the grid ({len(skipped)} tried); fix the grid or the job:"]
                          + [f"  {point_label(s['point'])}: {s['reason']}" for s in skipped])
    if max_parallel is not None and max_parallel < 1:
        raise ConfigError(f"--max-parallel: must be >= 1 (got {max_parallel}); it is the %K of --array")
    if executor.sees_paths(dry_run=dry_run):  # every point's token files, before anything is created or submitted
        problems = [f"{point_label(p)}: {line}" for p, _, resolved, _ in feasible for line in data_problems(resolved)]
        if problems:
            raise ConfigError(problems)
    if not dry_run:  # a dry run writes nothing, not even a probe
        stages.check_sweep_checkpoint_dirs([(point_label(p), resolved) for p, _, resolved, _ in feasible])
    parallel = max_parallel or (job.sweep.max_parallel if job.sweep else 4)
    array = f"0-{len(feasible) - 1}%{min(parallel, len(feasible))}"
    executor.check(job, array=array)  # before anything is written: a backend without job arrays refuses here
    root = create_run_dir(job.runs_dir, job.name)
    try:
        executor.check_sweep([(point_label(p), resolved) for p, _, resolved, _ in feasible], root, array)
    except ConfigError:
        shutil.rmtree(root, ignore_errors=True)
        raise
    tasks: list[TaskSpec] = []
    for task_id, (point, point_job, resolved, plan) in enumerate(feasible):
        task_dir = root / TASKS_DIR / str(task_id)
        task_dir.mkdir(parents=True)
        init_run_dir(task_dir)
        write_job_files(task_dir, point_job, resolved, plan)
        tasks.append((task_id, task_dir, resolved))
    write_job_files(root, job, feasible[0][2], feasible[0][3])
    sweep = {"name": job.name, "grid": grid, "max_parallel": parallel, "array": array, "executor": executor.name,
             "job_id": None, "tasks": [{"task_id": i, "point": p, "run_dir": f"{TASKS_DIR}/{i}"}
                                       for i, (p, _, _, _) in enumerate(feasible)],
             "skipped": skipped}
    write_json(root / SWEEP_FILE, sweep)
    submission = launch(root, feasible[0][2], executor, note, tasks, array=array, max_parallel=parallel,
                        dry_run=dry_run)
    sweep["job_id"] = submission.job_id
    write_json(root / SWEEP_FILE, sweep)
    return submission, sweep
