"""Make a job's relative paths absolute before it leaves the login node.

The ranks run in other working directories (the run dir, a compute node's $HOME), so a relative
`train.data` or `checkpoint.dir` would point somewhere else there. The rule (README, "Paths"):

- an input file or folder the job file names (INPUT_PATHS) is taken relative to the job file's folder,
  so the same job reads the same files from wherever it is submitted;
- a value given with `--set` is taken relative to the current directory, as the user typed it there;
- where the run writes (OUTPUT_PATHS: runs_dir, checkpoint.dir) is taken relative to the current
  directory, where a user looks for `runs/`.

`resolve_data_paths` applies the first two to a job's plain data when a job file is loaded, before
validation (model.init_from is read while the job is validated); `absolute_paths` makes every path of a
validated job absolute against one folder, the current directory at submit (which places the outputs).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from hpctrain.config.job import Job

Path = tuple[str, ...]

INPUT_PATHS: tuple[Path, ...] = (
    ("train", "data"), ("train", "eval_data"), ("model", "init_from"), ("template_dir",),
    ("cluster", "topology", "nvidia_smi"), ("cluster", "topology", "slurm_topology"), ("container", "image"),
    ("runtime", "python"), ("entrypoint", "script"),
)
COMMAND_NAMES = {("runtime", "python")}  # a bare name (python3) is looked up on PATH: only a path with a / is one
OUTPUT_PATHS: tuple[Path, ...] = (("runs_dir",), ("checkpoint", "dir"))  # absolute_paths, at submit
NOT_A_PATH: dict[Path, str] = {("train", "data"): "synthetic"}  # the value that names no file


def _absolute(path: Optional[str], base: str) -> Optional[str]:
    if path is None or "://" in path:  # a URI (docker://...) is no local path
        return path
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def _from_set(path: Path, overrides: Mapping[Path, str]) -> bool:
    return any(path[:end] in overrides for end in range(1, len(path) + 1))


def resolve_data_paths(data: Any, job_file: str, overrides: Mapping[Path, str], cwd: Optional[str] = None) -> Any:
    """Make the path fields of a job's plain data absolute, in place, by the rule above. `overrides`: the
    dotted paths `--set` wrote (a Source's overrides). Values of the wrong type are left for validation."""
    cwd = cwd or os.getcwd()
    job_dir = os.path.dirname(os.path.abspath(os.path.join(cwd, job_file)))
    if not isinstance(data, dict):
        return data
    for path in INPUT_PATHS:
        node: Any = data
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        value = node.get(path[-1]) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value or value == NOT_A_PATH.get(path):
            continue
        if path in COMMAND_NAMES and "/" not in value:
            continue
        base = cwd if _from_set(path, overrides) else job_dir
        node[path[-1]] = _absolute(value, base)
    grid = (data.get("sweep") or {}).get("grid") if isinstance(data.get("sweep"), dict) else None
    if isinstance(grid, dict):  # a sweep over an input path: each value by the same rule as the field's
        for key in list(grid):
            path = tuple(str(key).split("."))
            if path in INPUT_PATHS and isinstance(grid[key], list):
                base = cwd if _from_set(("sweep", "grid", str(key)), overrides) else job_dir
                grid[key] = [grid_path(path, value, base) for value in grid[key]]
    return data


def grid_path(path: Path, value: Any, base: str) -> Any:
    """One sweep value of the field at `path`, absolute against base when it names an input file."""
    if path not in INPUT_PATHS or not isinstance(value, str) or not value or value == NOT_A_PATH.get(path):
        return value
    return _absolute(value, base)


def absolute_paths(job: Job, base: str | None = None) -> Job:
    """A copy of job with train.data, model.init_from, runs_dir, checkpoint.dir, container.image, topology files and
    template_dir made absolute against base (default: the current directory)."""
    base = base or os.getcwd()
    train = job.train
    if train.data != "synthetic":
        train = train.model_copy(update={"data": _absolute(train.data, base)})
    train = train.model_copy(update={"eval_data": _absolute(train.eval_data, base)})
    topology = job.cluster.topology.model_copy(update={
        "nvidia_smi": _absolute(job.cluster.topology.nvidia_smi, base),
        "slurm_topology": _absolute(job.cluster.topology.slurm_topology, base),
    })
    return job.model_copy(update={
        "runs_dir": _absolute(job.runs_dir, base),
        "template_dir": _absolute(job.template_dir, base),
        "train": train,
        "model": (job.model.model_copy(update={"init_from": _absolute(job.model.init_from, base)})
                  if job.model is not None else None),
        "entrypoint": (job.entrypoint.model_copy(update={"script": _absolute(job.entrypoint.script, base)})
                       if job.entrypoint is not None else None),
        "checkpoint": job.checkpoint.model_copy(update={"dir": _absolute(job.checkpoint.dir, base)}),
        "container": job.container.model_copy(update={"image": _absolute(job.container.image, base)}),
        "cluster": job.cluster.model_copy(update={"topology": topology}),
    })
