"""A PID recorded in a run directory, and whether the process that has it now is still the one recorded.

PIDs are reused (after a reboot, or on a busy machine), so a live process with the recorded PID proves
nothing (issue 30 finding 4: `status` said RUNNING and `cancel` signalled another run's supervisor).
A recorded PID counts only when its process
- is alive and not a zombie,
- started at the recorded time, when one was recorded (`start_ticks`: /proc/PID/stat field 22, clock
  ticks after boot; the same process always has the same value, a reused PID almost never), and
- has a command line that names this run: an argument that is a path inside the run directory (or
  inside the sweep that holds it, whose supervisor serves all of its tasks).
Torch-free; Linux's /proc (elsewhere nothing can be checked and a live PID counts, as before).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from hpctrain.rundir.layout import TASKS_DIR


def start_ticks(pid: int) -> Optional[int]:
    """When process `pid` started (field 22 of /proc/PID/stat), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode("ascii", errors="replace")
        return int(stat[stat.rindex(")") + 2:].split()[19])  # after "pid (comm) ": field 3 is index 0
    except (OSError, ValueError, IndexError):
        return None


def command_line(pid: int, patience_s: float = 2.0) -> Optional[list[str]]:
    """The arguments of live, non-zombie process `pid`; None when there is no such process. Right after a
    fork the command line can still be empty (seen under gVisor): it is waited for, `patience_s` at most."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as handle:
                status = handle.read()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                raw = handle.read()
        except OSError:
            return None
        if any(line.startswith("State:") and line.split()[1:2] == ["Z"] for line in status.splitlines()):
            return None
        if raw or time.monotonic() > deadline:
            return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]
        time.sleep(0.01)


def names_run(argv: list[str], run_dir: Path) -> bool:
    """Whether an argument is an absolute path inside run_dir, or inside the sweep whose task run_dir is."""
    run = Path(os.path.realpath(run_dir))
    roots = [run] + ([run.parent.parent] if run.parent.name == TASKS_DIR else [])
    for arg in argv:
        if not arg.startswith("/"):
            continue
        path = Path(os.path.realpath(arg))
        if any(path == root or root in path.parents for root in roots):
            return True
    return False


def is_recorded_process(pid: int, run_dir: Path, recorded_start: Optional[int], *, needs: str = "",
                        patience_s: float = 2.0) -> bool:
    """Whether `pid` is still the process recorded for run_dir (module doc); `needs`: a word its
    command line must also hold (the program it runs)."""
    if not os.path.isdir("/proc/self"):
        return _exists(pid)
    argv = command_line(pid, patience_s)
    if argv is None:
        return False
    if recorded_start is not None and start_ticks(pid) != recorded_start:
        return False
    return (not needs or needs in argv) and names_run(argv, run_dir)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
