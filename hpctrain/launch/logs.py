"""`logs`: the per-rank, per-attempt log files of a run (logs/), and the batch script's output.

Rank logs are named by the global rank (hpctrain/rundir/ranks.py); a process that stopped before it
knew its rank left its output only in the launcher's log of its slot, logs/task-S.attempt-A.log,
which `--rank R` shows when rank R has no log of its own. Logs an executor keeps elsewhere (a
Volcano Job's pod output) come from `Executor.logs` (`remote_logs`). `follow_logs` (`logs -f`) prints
them as they grow until the run ends.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Optional

from hpctrain.errors import ConfigError
from hpctrain.launch.executor import RemoteLogs, executor_of
from hpctrain.launch.rundir import last_submission
from hpctrain.rundir.layout import LOGS_DIR
from hpctrain.rundir.ranks import TASK_LOG, rank_order_of, slot_of
from hpctrain.rundir.safe_files import check_inside
from hpctrain.rundir.terminal import printable

_RANK = re.compile(r"rank[-_.]?(\d+)")
_ATTEMPT = re.compile(r"attempt[-_.]?(\d+)")


@dataclass(frozen=True)
class LogFile:
    path: Path
    rank: Optional[int]  # None: not a rank log (the batch script's own output, ...)
    attempt: int


def remote_logs(run_dir: Path) -> Optional[RemoteLogs]:
    """The logs the run's executor keeps outside the run directory (with a note saying where the rest are),
    or None when they are all in run_dir (every backend but volcano)."""
    sub = last_submission(run_dir)
    if not sub or not sub.get("job_id"):
        return None
    return executor_of(sub).logs(run_dir, sub)


def parse_log_name(name: str) -> tuple[Optional[int], int]:
    """`rank-3.attempt-1.log` -> (3, 1); `batch-12.out` -> (None, 0)."""
    rank, attempt = _RANK.search(name), _ATTEMPT.search(name)
    return (int(rank.group(1)) if rank else None, int(attempt.group(1)) if attempt else 0)


def log_files(run_dir: Path) -> list[LogFile]:
    """Every file in logs/ and the batch scripts' own output (slurm-*.out), oldest attempt first."""
    folder = run_dir / LOGS_DIR
    paths = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    paths += sorted(run_dir.glob("slurm-*.out"))
    check_inside(run_dir, paths)  # `logs` prints them: never a file that a link outside the run names
    files = [LogFile(p, *parse_log_name(p.name)) for p in paths]
    return sorted(files, key=lambda f: (f.attempt, f.path.stat().st_mtime, f.path.name))


def pick_logs(run_dir: Path, rank: Optional[int] = None, attempt: Optional[int] = None) -> tuple[list[LogFile], str]:
    """(the logs of `rank` (default: every rank) in `attempt` (default: the newest), a note or "").

    When the ranks wrote no files of their own, their output is in the batch script's output files.
    """
    files = log_files(run_dir)
    if not files:
        raise ConfigError(f"RUN: no logs yet in {run_dir}; the job has not started (see `hpctrain status "
                          f"{run_dir}`)")
    ranked = [f for f in files if f.rank is not None]
    note = ""
    if not ranked:
        chosen = files
        if rank is not None:
            note = f"no per-rank log files in {run_dir / 'logs'}: every rank's output is in the batch output below"
    elif rank is not None:
        chosen = [f for f in ranked if f.rank == rank]
        if not chosen:
            chosen, note = _slot_logs(run_dir, files, rank)
        if not chosen:
            known = sorted({f.rank for f in ranked if f.rank is not None})
            raise ConfigError(f"--rank: no log for rank {rank} in {run_dir / 'logs'} (ranks with logs: {known}); "
                              "use one of those")
    else:
        chosen = ranked
    if attempt is None:
        return [f for f in chosen if f.attempt == max(g.attempt for g in chosen)], note
    picked = [f for f in chosen if f.attempt == attempt]
    if not picked:
        attempts = sorted({f.attempt for f in chosen})
        raise ConfigError(f"--attempt: no attempt {attempt} (attempts logged: {attempts}); use one of those")
    return picked, note


def _slot_logs(run_dir: Path, files: list[LogFile], rank: int) -> tuple[list[LogFile], str]:
    """The launcher's logs of the slot that runs `rank`, for a rank that never wrote its own."""
    order = rank_order_of(run_dir)
    if order is not None and rank not in order:
        return [], ""
    slot = slot_of(rank, order)
    found = [f for f in files if (m := TASK_LOG.match(f.path.name)) and int(m.group(1)) == slot]
    note = (f"rank {rank} wrote no log of its own (it stopped before it knew its rank): this is what the launcher "
            f"caught from its slot {slot}") if found else ""
    return found, note


def follow_logs(run_dir: Path, rank: Optional[int], attempt: Optional[int], out: BinaryIO, *,
                ended: Callable[[], bool], note: Callable[[str], None], poll_s: float = 0.5,
                check_every_s: float = 2.0) -> None:
    """`logs -f`: print the chosen logs (pick_logs) and what is appended to them, whole lines at a time, until
    `ended()` says the run has ended; then the rest. Without `attempt`, a restart's new attempt is followed
    when its logs appear (`note` says so). Logs that do not exist yet are waited for while the run goes on.
    Without `rank` (every rank's logs), a `==> path <==` line heads each file's lines, as `tail -f` does."""
    offsets: dict[Path, int] = {}
    shown: Optional[Path] = None  # the file whose lines were printed last (a header before another's)
    following: Optional[int] = None  # the attempt followed
    previous: list[LogFile] = []  # its files
    checked_at, finished = float("-inf"), False
    while True:
        if time.monotonic() - checked_at >= check_every_s:
            finished, checked_at = ended(), time.monotonic()  # asked before reading: all it wrote is read below
        try:
            files, why = pick_logs(run_dir, rank, attempt)
        except ConfigError:
            if finished:
                raise  # the run ended without the logs asked for
            files, why = [], ""
        if files and files[0].attempt != following:
            for log in previous:  # the end of the attempt that ended, before the next one's lines
                shown = _print_new(log.path, offsets, out, log.path if rank is not None else shown, last=True)
            if following is not None:
                note(f"attempt {files[0].attempt} began; following its logs")
            elif why:
                note(why)
            following, previous = files[0].attempt, files
        for log in files:  # one rank: its lines as they are; every rank: a header whenever the file changes
            shown = _print_new(log.path, offsets, out, log.path if rank is not None else shown, last=finished)
        out.flush()
        if finished:
            return
        time.sleep(poll_s)


def _print_new(path: Path, offsets: dict[Path, int], out: BinaryIO, shown: Optional[Path], last: bool) -> Path:
    """Print what `path` has beyond offsets[path] (only whole lines unless `last`); a `==> path <==` header
    first when another file was printed last. Returns the file printed last."""
    start = offsets.get(path, 0)
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size < start:  # rewritten from the start
                start = 0
            handle.seek(start)
            chunk = handle.read(size - start)
    except OSError:  # moved away or not readable (yet): try again at the next poll
        return shown if shown is not None else path
    if not last:
        chunk = chunk[:chunk.rfind(b"\n") + 1]
    if not chunk:
        return shown if shown is not None else path
    if shown != path:
        out.write(f"==> {printable(str(path))} <==\n".encode())
    out.write(chunk)
    offsets[path] = start + len(chunk)
    return path
