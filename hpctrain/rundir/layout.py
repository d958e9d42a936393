"""The run directory's names (docs/architecture.md), and creating, finding and listing run directories.

    runs/<name-slug>-<YYYYmmdd-HHMMSS>/
        job.yaml  job.resolved.yaml  plan.json  submit/  logs/  metrics.jsonl  ranks/
        events.jsonl  checkpoints/  run_id

A sweep is such a directory with `sweep.json` and one run directory per array task in `tasks/<i>/`.
Every stage names these files through the constants here, never by a literal of its own.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.rundir.safe_files import write_atomic

JOB_FILE = "job.yaml"  # what the user submitted (after overrides)
RESOLVED_FILE = "job.resolved.yaml"  # the planned job: the only input of render and the runtime
PLAN_FILE = "plan.json"
SUBMIT_DIR = "submit"  # the rendered script, the recipe, the executors' files
LOCAL_STATE_FILE = "local.json"  # in submit/: the local executor's state of the job (what sacct is to Slurm)
LOGS_DIR = "logs"  # logs/rank-R.attempt-A.log (ranks.py)
METRICS_FILE = "metrics.jsonl"
RANKS_DIR = "ranks"  # ranks/rank-R.json (ranks.py)
EVENTS_FILE = "events.jsonl"
CHECKPOINTS_DIR = "checkpoints"  # the default checkpoint.dir
RUN_ID_FILE = "run_id"  # the run's identity, written once; checkpoints record it (checkpoints.py)
DATA_IDENTITY_FILE = "data.json"  # the token files the run trains on, checked at every start (data_identity.py)
SWEEP_FILE = "sweep.json"
TASKS_DIR = "tasks"
# Files between the batch script (on the host) and the runtime (maybe in a container): the runtime
# asks for a requeue, or says that a rank refused its input (exit 2: nothing to requeue for).
REQUEUE_MARKER = "requeue-requested"
BAD_INPUT_MARKER = "bad-input"
BAD_INPUT_MARKER_ENV = "HPCTRAIN_BAD_INPUT_MARKER"  # where the batch script wants that marker
# The exit path's memory of the step its last requeue-worthy failure happened at (one line).
FAILED_STEP_FILE = "failed-step"


def slugify(name: str, max_length: int = 48) -> str:
    """A name safe in a path and a shell word: `My job (v2)!` -> `my-job-v2`."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:max_length].strip("-")
    return slug or "job"


def create_run_dir(runs_dir: str | os.PathLike[str], name: str, now: Optional[float] = None) -> Path:
    """A new, empty `runs_dir/<slug>-<timestamp>[-N]/` with `submit/` and `logs/` inside."""
    root = Path(runs_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"runs_dir: cannot create {str(root)!r} ({exc.strerror}); set runs_dir to a "
                          "writable folder") from None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = f"{slugify(name)}-{stamp}"
    for n in range(1, 1000):
        path = root / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        init_run_dir(path)
        return path.resolve()
    raise ConfigError(f"runs_dir: too many runs named {base} in {root}; clean it up")


def init_run_dir(path: Path) -> None:
    for sub in (SUBMIT_DIR, LOGS_DIR):
        (path / sub).mkdir(parents=True, exist_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write a file atomically (readers never see half of it), never through a symbolic link."""
    write_atomic(path, text, tmp=str(path.with_name(f".{path.name}.tmp")))


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def is_sweep(run_dir: Path) -> bool:
    return (run_dir / SWEEP_FILE).is_file()


def task_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's task run directories in task-id order."""
    root = sweep_dir / TASKS_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / EVENTS_FILE).exists() or (path / JOB_FILE).exists() or is_sweep(path))


def find_run(spec: str, runs_dir: str = "runs") -> Path:
    """A run directory from a path, or the newest run in runs_dir named spec or <spec>-<timestamp>."""
    path = Path(spec)
    if is_run_dir(path):
        return path.resolve()
    root = Path(runs_dir)
    candidates = []
    if root.is_dir() and "/" not in spec:
        # A run is <slug>-YYYYMMDD-HHMMSS (plus -N on a clash): a bare prefix must not pick another job's run.
        named = re.compile(re.escape(slugify(spec)) + r"-\d{8}-\d{6}(-\d+)?") if spec else None
        candidates = [p for p in root.iterdir()
                      if p.is_dir() and (p.name == spec or (named is not None and named.fullmatch(p.name)))]
    if not candidates:
        known = sorted(p.name for p in root.iterdir() if p.is_dir())[-5:] if root.is_dir() else []
        hint = f"recent runs in {runs_dir}/: {', '.join(known)}" if known else f"no runs in {runs_dir}/"
        raise ConfigError(f"RUN: no run directory {spec!r}; give a run directory path or a run name ({hint})")
    return max(candidates, key=lambda p: (p.stat().st_mtime, p.name)).resolve()


def newest_run(runs_dir: str = "runs") -> Path:
    """The most recently created run directory (for `hpctrain status` without RUN)."""
    root = Path(runs_dir)
    runs = [p for p in root.iterdir() if p.is_dir() and (p / EVENTS_FILE).exists()] if root.is_dir() else []
    if not runs:
        raise ConfigError(f"RUN: no runs in {runs_dir}/; submit one with `hpctrain submit job.yaml` or give RUN")
    return max(runs, key=lambda p: (p.stat().st_mtime, p.name)).resolve()
