"""submit/local.json: the local executor's record of one job or task (what sacct is to a Slurm job).

Written by the local supervisor (launch/local/supervisor.py) and read by status, resume, cancel and
the doctor. A reader gets a checked record or a RunDirError (one line, exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hpctrain.rundir.layout import LOCAL_STATE_FILE, SUBMIT_DIR
from hpctrain.rundir.read import field, int_list, read_json_object

_FIELDS: dict[str, tuple[type, ...]] = {
    "state": (str,), "reason": (str,), "pid": (int,), "attempt": (int,), "task_id": (int,),
    "start_time": (int, float), "end_time": (int, float), "hosts": (list,), "pid_start": (int,),
}


def local_state_path(run_dir: Path) -> Path:
    return Path(run_dir) / SUBMIT_DIR / LOCAL_STATE_FILE


def read_local_state(run_dir: Path) -> Optional[dict[str, Any]]:
    """The record, None when there is none; a wrongly typed field is a RunDirError."""
    path = local_state_path(run_dir)
    data = read_json_object(path)
    if data is None:
        return None
    for key, kinds in _FIELDS.items():
        field(data, key, kinds, path)
    int_list(data, "exit_codes", path)
    return data
