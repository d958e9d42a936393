"""The optional API for your own training script under hpctrain (`entrypoint:` in job.yaml; issue 28).

    from hpctrain import job
    start = load_your_checkpoint(job.checkpoint_dir())        # HPCTRAIN_CHECKPOINT_DIR
    for step in range(start, steps):
        ...
        job.log(step, loss=loss.item())                       # rank 0 appends to the run's metrics.jsonl
        if agreed(job.should_stop()):                         # every rank must stop at the same step
            save_your_checkpoint(job.checkpoint_dir(), step)
            sys.exit(0)                                       # exit 0 after the signal: saved, requeue me

The rule (docs/architecture.md section 5): on the requeue signal (restart.signal, or SIGTERM) every rank's
program gets restart.script_signal (default SIGTERM) and has restart.grace_s to save and exit. Exit 0 after
it = saved, requeue me; exit 0 without it = finished; exit 2 = bad input (never requeued); anything else is
a crash (requeued within restart.max_requeues unless it fails again at the same step). A script that uses
none of this still runs: it reads torchrun's variables, and its own SIGTERM handler works as under torchrun.

Imports neither torch nor pydantic: safe in any training script. Outside hpctrain (no HPCTRAIN_RUN_DIR)
every function still answers: should_stop() sees only the signal, log() writes nothing.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Optional

__all__ = ["attempt", "checkpoint_dir", "log", "rank", "requeue_requested", "run_dir", "should_stop"]

_SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "TERM": signal.SIGTERM, "INT": signal.SIGINT,
            "HUP": signal.SIGHUP}
_state: dict[str, Any] = {"caught": None, "installed": False, "truncated": False}


def run_dir() -> Optional[Path]:
    """The run directory (HPCTRAIN_RUN_DIR), None outside hpctrain."""
    value = os.environ.get("HPCTRAIN_RUN_DIR")
    return Path(value) if value else None


def checkpoint_dir() -> Path:
    """Where to save and look for checkpoints (HPCTRAIN_CHECKPOINT_DIR: checkpoint.dir, else RUN/checkpoints)."""
    value = os.environ.get("HPCTRAIN_CHECKPOINT_DIR")
    if value:
        return Path(value)
    run = run_dir()
    return run / "checkpoints" if run is not None else Path("checkpoints")


def attempt() -> int:
    """0 for the first start, then one more per requeue or resume (HPCTRAIN_ATTEMPT)."""
    value = os.environ.get("HPCTRAIN_ATTEMPT", "")
    return int(value) if value.isdigit() else 0


def rank() -> int:
    """This process's global rank (torchrun's RANK; 0 for a single process)."""
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else 0


def _catch(signum: int, frame: Any) -> None:
    _state["caught"] = signum


def _install() -> None:
    """From the first should_stop() on, the script signal only sets a flag (unless the script has a handler)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    signum = _SIGNALS.get(os.environ.get("HPCTRAIN_SCRIPT_SIGNAL", "TERM"), signal.SIGTERM)
    try:
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _catch)
    except ValueError:  # not the main thread: the stop file still answers
        pass


def should_stop() -> bool:
    """True once the stop was asked for this attempt: the script signal reached this process, or hpctrain
    recorded the requeue signal in the run directory. Ranks may see it one step apart: agree (an
    all-reduce MAX of this value) before saving, so that every rank stops at the same step."""
    _install()
    if _state["caught"] is not None:
        return True
    stop_file = os.environ.get("HPCTRAIN_STOP_FILE")
    if not stop_file:
        return False
    try:
        with open(stop_file, encoding="utf-8") as handle:
            return handle.read().strip() == str(attempt())
    except OSError:
        return False


def requeue_requested() -> bool:
    """True when exiting now (0, after saving) will start the job again: the stop came from the requeue
    signal. In this version every stop hpctrain asks for is one (a cancel kills the job without a requeue)."""
    return should_stop()


def log(step: int, **metrics: Any) -> None:
    """Rank 0: one line {"step", **metrics, "attempt"} appended to the run's metrics.jsonl (O_APPEND, never
    through a symbolic link), which status, doctor, report and the trackers read. The first call of a
    process drops the lines of steps >= `step` an earlier attempt logged after its last checkpoint, so every
    step appears once. Other ranks, and runs outside hpctrain, write nothing."""
    run = run_dir()
    if run is None or rank() != 0:
        return
    from hpctrain.rundir.events import append_line
    from hpctrain.rundir.layout import METRICS_FILE
    from hpctrain.rundir.metrics import truncate_metrics

    path = run / METRICS_FILE
    if not _state["truncated"]:
        _state["truncated"] = True
        if path.exists():
            truncate_metrics(path, int(step) - 1)
    append_line(path, {"step": int(step), **metrics, "attempt": attempt()})
