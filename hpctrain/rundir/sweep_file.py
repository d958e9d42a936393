"""sweep.json: a sweep's grid, its points, the skipped ones and the array job id (written by launch/sweep.py).

Readers (status, report, doctor) get the task entries checked: each has an integer task_id and a
run_dir inside the sweep; anything else is a RunDirError (one line, exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.rundir.layout import SWEEP_FILE
from hpctrain.rundir.read import damaged, field, read_json_object


def read_sweep(sweep_dir: Path) -> dict[str, Any]:
    """sweep.json with checked `tasks` (and `skipped`) lists; {} when there is none."""
    path = Path(sweep_dir) / SWEEP_FILE
    data = read_json_object(path) or {}
    for key in ("tasks", "skipped"):
        entries = field(data, key, list, path, default=[])
        for entry in entries:
            if not isinstance(entry, dict):
                raise damaged(path, f"an entry of {key!r} is {entry!r}, not an object")
            if key == "tasks":
                if field(entry, "task_id", int, path) is None or field(entry, "run_dir", str, path) is None:
                    raise damaged(path, f"task entry {entry!r} lacks task_id or run_dir")
                if Path(entry["run_dir"]).is_absolute() or ".." in Path(entry["run_dir"]).parts:
                    raise damaged(path, f"task {entry['task_id']}: run_dir {entry['run_dir']!r} is not inside the sweep")
            else:
                field(entry, "reason", str, path)
                field(entry, "point", dict, path)
    return data
