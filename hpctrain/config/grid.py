"""sweep.grid: the one check of every grid key and value, used by `validate` and by `sweep` alike.

A grid point is the job with one `--set KEY=VALUE` per grid key (`point_overrides`). Each key and each of
its values must pass the schema on its own: a typo (`parallel.tpp`) or a wrongly typed value is the
user's mistake and is refused (exit 2) wherever the grid is read. Cross-field rules are not applied
per value: a value may only fit together with another key's value (tp with dp), and `sweep` skips an
infeasible combination with the planner's reason instead.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Optional

from hpctrain.config.job import Job
from hpctrain.config.limits import MAX_GRID_POINTS
from hpctrain.config.yaml_source import Source
from hpctrain.errors import ConfigError


def point_overrides(point: dict[str, Any]) -> list[str]:
    """The `--set` overrides that make one grid point out of the base job."""
    return [f"{key}={json.dumps(value)}" for key, value in point.items()]


def base_data(job: Job) -> dict[str, Any]:
    """The job a grid is applied to: the job without its sweep section."""
    from hpctrain.config import job_to_dict

    return {k: v for k, v in job_to_dict(job).items() if k != "sweep"}


def _located(source: Optional[Source], key: str) -> str:
    """`FILE:LINE: ` of the grid key when the job file is known (validate), else nothing (sweep)."""
    return f"{source.locate(('sweep', 'grid', key))}: " if source is not None else ""


def grid_problems(job: Job, grid: dict[str, list[Any]], source: Optional[Source] = None) -> list[str]:
    """One line per grid key or value the schema refuses, and for a grid of too many points."""
    from hpctrain.config.loader import schema_problems
    from hpctrain.config.overrides import apply_overrides

    points = 1
    for values in grid.values():
        points *= max(len(values), 1)
    if points > MAX_GRID_POINTS:
        sizes = " x ".join(str(len(v)) for v in grid.values())
        return [f"{_located(source, next(iter(grid)))}sweep.grid: {sizes} = {points} points, more than "
                f"{MAX_GRID_POINTS}; sweep fewer values, or split the grid over several sweeps"]
    base = base_data(job)
    problems: list[str] = []
    for key, values in grid.items():
        where = _located(source, key)
        if key.split(".")[0] == "sweep":
            problems.append(f"{where}sweep.grid.{key}: a grid cannot set the sweep section (got {key!r}); "
                            "grid over job keys such as parallel.tp")
            continue
        seen: set[str] = set()
        for value in values:
            override = point_overrides({key: value})[0]
            point_source = Source("<grid>")
            try:
                data = apply_overrides(copy.deepcopy(base), [override], point_source)
                lines = schema_problems(data, point_source)
            except ConfigError as exc:
                lines = exc.problems
            for line in lines:
                detail = line.split(": ", 1)[1] if line.startswith("--set ") else line
                same = re.sub(r" \(got .*?\)", "", detail)
                if same not in seen:  # an unknown key fails the same way for every value: say it once
                    seen.add(same)
                    problems.append(f"{where}sweep.grid.{key}: value {json.dumps(value)[:60]}: {detail}")
    return problems


def check_grid(job: Job, grid: dict[str, list[Any]], source: Optional[Source] = None) -> None:
    """grid_problems as a ConfigError (exit 2), or nothing."""
    problems = grid_problems(job, grid, source)
    if problems:
        raise ConfigError(problems)
