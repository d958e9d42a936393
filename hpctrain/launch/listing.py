"""`hpctrain status` without RUN: every run of a runs directory, newest first (name, state, step, restarts, age)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Optional

from hpctrain.errors import HpctrainError
from hpctrain.launch.status import run_status
from hpctrain.rundir.layout import is_run_dir
from hpctrain.rundir.terminal import printable

# create_run_dir names runs <slug>-YYYYmmdd-HHMMSS[-N] (local time): the creation time, without reading a file.
_STAMP = re.compile(r"-(\d{8}-\d{6})(?:-\d+)?$")


def created_s(run_dir: Path) -> float:
    """When the run was created: from its name, else its folder's modification time."""
    found = _STAMP.search(run_dir.name)
    if found:
        try:
            return time.mktime(time.strptime(found.group(1), "%Y%m%d-%H%M%S"))
        except (ValueError, OverflowError):
            pass
    return run_dir.stat().st_mtime


def list_runs(runs_dir: str, env: Optional[Mapping[str, str]] = None) -> list[dict[str, Any]]:
    """One row per run directory in runs_dir, newest first. A run that cannot be read is listed with its error."""
    root = Path(runs_dir)
    runs = [p for p in root.iterdir() if is_run_dir(p)] if root.is_dir() else []
    rows = []
    now = time.time()
    for path in sorted(runs, key=lambda p: (created_s(p), p.name), reverse=True):
        row: dict[str, Any] = {"name": path.name, "run_dir": str(path.resolve()), "age_s": round(now - created_s(path))}
        try:
            status = run_status(path, env, details=False)  # what the table shows, no more
        except HpctrainError as exc:  # one damaged run must not hide the others
            rows.append({**row, "kind": "job", "state": "UNREADABLE", "reason": str(exc).splitlines()[0]})
            continue
        tasks = status.get("tasks") or []
        row.update(kind=status["kind"], state=status["state"], job_id=status.get("job_id"),
                   executor=status.get("executor"), step=status.get("step"), steps=status.get("steps"),
                   restarts=max([status.get("restarts") or 0, *[t.get("restarts") or 0 for t in tasks]]),
                   tasks=len(tasks) if status["kind"] == "sweep" else None)
        rows.append(row)
    return rows


def age_text(seconds: float) -> str:
    """`42s`, `7m`, `3h`, `2d`."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def format_runs(rows: list[dict[str, Any]], runs_dir: str) -> str:
    """The table `hpctrain status` prints without RUN."""
    from tabulate import tabulate

    if not rows:
        return f"no runs in {runs_dir}/; submit one with `hpctrain submit job.yaml`"
    table = []
    for row in rows:
        if row.get("kind") == "sweep":
            step = f"sweep of {row.get('tasks')}"
        elif row.get("step") is not None:
            step = f"{row['step']}/{row.get('steps') or '?'}"
        else:
            step = f"-/{row.get('steps') or '?'}"
        table.append([row["name"], row["state"], step, row.get("restarts", 0), age_text(row["age_s"])])
    return printable(tabulate(table, headers=["run", "state", "step", "restarts", "age"], tablefmt="simple"))


def hidden_note(dry_runs: int) -> str:
    """The line under the list when `status` hid dry runs (they never ran: no state to follow)."""
    if not dry_runs:
        return ""
    return (f"({dry_runs} dry run{'s' if dry_runs != 1 else ''} hidden; `hpctrain status --all` lists them, "
            "`hpctrain clean --dry-runs` removes those that never ran)")
