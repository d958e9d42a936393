"""One live set of ranks per run directory: `submit/ranks.lock`, a lock that names its owner.

Two trainings in one run directory write every metrics line and every checkpoint twice, so the local
executor takes this lock before it starts a task's ranks and hands the locked file to them (the
ranks inherit the open file, and `flock` locks belong to the open file, not to a process): the lock
is held while the supervisor OR any rank of the set lives, and the kernel drops it when the last of
them exits, however it exits (SIGKILL included). No stale lock survives a crash on a file system
where `flock` works. Where it does not (some NFS/Lustre mounts answer ENOLCK/EOPNOTSUPP), the owner
written in the file decides: a dead pid on this host is taken over, a live one (or another host's)
refuses.

The file holds one JSON object: host, pid (the supervisor), job_id, since (epoch s), ranks (pids), starts
(pid -> start time, so that a pid reused by another process does not keep the lock alive).
Torch-free: the login path (resume, status) reads it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.rundir.process import start_ticks

LOCK_NAME = "ranks.lock"  # in the run directory's submit/ folder
_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
_PROBE_PATIENCE_S = 1.0  # how long acquire() waits out a reader's momentary shared lock


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / "submit" / LOCK_NAME


@dataclass(frozen=True)
class Owner:
    """Who holds (or last held) a run directory's lock, as its file says."""

    host: str
    pid: int
    job_id: Optional[str] = None
    since: Optional[float] = None
    ranks: tuple[int, ...] = ()
    starts: tuple[tuple[int, int], ...] = ()  # (pid, start ticks) of the owner and the ranks (rundir/process.py)

    def is_live_here(self) -> bool:
        """A process with one of the recorded pids lives on this host, started when recorded (a pid that
        another process has now does not count)."""
        started = dict(self.starts)
        return any(pid_alive(pid) and started.get(pid) in (None, start_ticks(pid)) for pid in (self.pid, *self.ranks))

    def describe(self) -> str:
        job = f"job {self.job_id}, " if self.job_id else ""
        ranks = f", rank pids {' '.join(map(str, self.ranks))}" if self.ranks else ""
        return f"{job}host {self.host}, pid {self.pid}{ranks}"


class RunLockedError(ConfigError):
    """A second set of ranks was about to start in a run directory whose ranks are still live (exit 2)."""

    def __init__(self, run_dir: Path, owner: Optional[Owner]) -> None:
        self.owner = owner
        who = owner.describe() if owner else "owner unknown"
        super().__init__(f"RUN: {run_dir} already has live ranks ({who}); a second training there would write "
                         f"every step twice: wait for it or `hpctrain cancel {run_dir}` first")


def read_owner(path: Path) -> Optional[Owner]:
    """The owner written in a lock file; None when the file is missing, empty or not ours."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ranks = tuple(int(p) for p in data.get("ranks") or ())
        starts = tuple((int(p), int(t)) for p, t in (data.get("starts") or {}).items() if t is not None)
        return Owner(str(data["host"]), int(data["pid"]), data.get("job_id"), data.get("since"), ranks, starts)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this host (and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc (not Linux): kill(0) said it exists
    return not any(line.startswith("State:") and line.split()[1] == "Z" for line in status.splitlines())


def _owner_is_live(owner: Optional[Owner]) -> bool:
    """Without flock: a lock of this host is live while its supervisor or a rank lives; another host's always is."""
    if owner is None:
        return False
    if owner.host != socket.gethostname():
        return True  # cannot look at another host's processes: refuse rather than train twice
    return owner.is_live_here()


class RunLock:
    """A held lock. `fd` is passed to the ranks (subprocess pass_fds) so that they hold it too."""

    def __init__(self, path: Path, fd: int, owner: Owner) -> None:
        self.path, self.fd, self.owner = path, fd, owner

    def update(self, **fields: Any) -> None:
        """Rewrite the owner record in place (the same file: a new one would not be the locked one)."""
        data = {"host": self.owner.host, "pid": self.owner.pid, "job_id": self.owner.job_id,
                "since": self.owner.since, "ranks": list(self.owner.ranks), **fields}
        data["starts"] = {str(pid): start_ticks(pid) for pid in (data["pid"], *data["ranks"])}
        self.owner = Owner(data["host"], data["pid"], data["job_id"], data["since"], tuple(data["ranks"]),
                           tuple((int(p), t) for p, t in data["starts"].items() if t is not None))
        text = (json.dumps(data) + "\n").encode("utf-8")
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text, 0)
        except OSError:  # a full disk: the lock itself still holds, only the owner's name is missing
            pass

    def release(self) -> None:
        """Close our descriptor; the lock is gone once the ranks that inherited it have exited too."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def acquire(run_dir: Path, job_id: Optional[str] = None) -> RunLock:
    """Take the run directory's lock for this process (and the ranks it will pass `fd` to).

    Raises RunLockedError naming the owner when a live set of ranks holds it.
    """
    path = lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)  # update() truncates it
    deadline = time.monotonic() + _PROBE_PATIENCE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno in _BUSY and time.monotonic() < deadline:
                time.sleep(0.05)  # perhaps only a reader's probe (live_owner), which lets go at once
                continue
            if exc.errno in _BUSY or _owner_is_live(read_owner(path)):  # flock unsupported: the file decides
                os.close(fd)
                raise RunLockedError(run_dir, read_owner(path)) from None
            break
    lock = RunLock(path, fd, Owner(socket.gethostname(), os.getpid(), job_id, time.time()))
    lock.update()
    return lock


def adopt(run_dir: Path, fd: int, job_id: Optional[str] = None) -> RunLock:
    """The lock held through an inherited descriptor `fd` (the client took it and passed it on); this process
    becomes the owner named in the file."""
    lock = RunLock(lock_path(run_dir), fd, Owner(socket.gethostname(), os.getpid(), job_id, time.time()))
    lock.update()
    return lock


def live_owner(run_dir: Path) -> Optional[Owner]:
    """The owner of a live set of ranks in run_dir, or None when no process holds the lock."""
    path = lock_path(run_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            return read_owner(path) or Owner("?", 0)
        owner = read_owner(path)
        return owner if _owner_is_live(owner) else None
    finally:
        os.close(fd)  # also drops the shared lock we may have just taken
    return None


def check_free(run_dir: Path) -> None:
    """Raise RunLockedError when live ranks hold run_dir (before starting anything in it)."""
    owner = live_owner(run_dir)
    if owner is not None:
        raise RunLockedError(run_dir, owner)
