"""The launcher's view of run directories: the contract itself lives in `hpctrain.rundir`.

Kept so that launch code (and other helpers' branches) importing `hpctrain.launch.rundir` keep
working; new code imports `hpctrain.rundir.<module>` directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from hpctrain.rundir.events import append_event, now_iso, read_events
from hpctrain.rundir.layout import (EVENTS_FILE, SWEEP_FILE, TASKS_DIR, create_run_dir, find_run, init_run_dir,
                                    is_sweep, newest_run, slugify, task_dirs, write_json, write_text)

EVENTS = EVENTS_FILE

__all__ = ["EVENTS", "SWEEP_FILE", "TASKS_DIR", "append_event", "create_run_dir", "find_run", "init_run_dir",
           "is_sweep", "last_submission", "newest_run", "now_iso", "read_events", "read_json", "slugify",
           "task_dirs", "write_json", "write_text"]


def read_json(path: Path) -> Any:
    """A JSON file the launcher wrote itself (specs, sweep.json), or None when missing or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def last_submission(run_dir: Path) -> Optional[dict[str, Any]]:
    """The newest `submitted` event (executor, job_id, ...), or None."""
    subs = [e for e in read_events(run_dir) if e.get("event") == "submitted"]
    return subs[-1] if subs else None
