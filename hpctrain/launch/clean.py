"""`clean --dry-runs`: remove the run directories that `submit/sweep --dry-run` left and that never ran.

A directory qualifies only when nothing ever ran in it: its events (and each sweep task's) are all `dry_run`,
and it holds no metrics, logs, rank summaries or checkpoints. Anything else (a run that was submitted, a
resume's dry run inside a real run, a folder that is not a run, a link) is left alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hpctrain.errors import HpctrainError
from hpctrain.rundir.events import DRY_RUN, read_events
from hpctrain.rundir.layout import (
    CHECKPOINTS_DIR, EVENTS_FILE, LOCAL_STATE_FILE, LOGS_DIR, METRICS_FILE, RANKS_DIR, SUBMIT_DIR, TASKS_DIR, is_run_dir,
)


def never_ran(run_dir: Path) -> bool:
    """Only dry_run events, and no trace of a rank, here and in every task directory below."""
    folders = [run_dir, *sorted((run_dir / TASKS_DIR).iterdir())] if (run_dir / TASKS_DIR).is_dir() else [run_dir]
    for folder in folders:
        if folder.is_symlink() or not folder.is_dir():
            return False
        try:
            events = read_events(folder) if (folder / EVENTS_FILE).exists() else []
        except HpctrainError:  # damaged: not ours to judge, keep it
            return False
        if folder == run_dir and not any(e.get("event") == DRY_RUN for e in events):
            return False
        if any(e.get("event") != DRY_RUN for e in events) or (folder / METRICS_FILE).exists():
            return False
        if (folder / SUBMIT_DIR / LOCAL_STATE_FILE).exists() or any(folder.glob("slurm-*.out")):
            return False  # a scheduler (or the local supervisor) had it
        for sub in (LOGS_DIR, RANKS_DIR, CHECKPOINTS_DIR):
            if (folder / sub).is_symlink() or ((folder / sub).is_dir() and any((folder / sub).iterdir())):
                return False
    return True


def dry_runs(runs_dir: str) -> list[Path]:
    """The run directories directly in runs_dir that only a dry run wrote, by name."""
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if not p.is_symlink() and is_run_dir(p) and never_ran(p))


def remove(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path)
