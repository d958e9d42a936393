"""Files of a run directory and symbolic links: writers never follow one, readers never leave the run through one.

A run directory is shared with people and tools, and a symlink planted there (by a careless copy or on
purpose) must not turn hpctrain's writes into writes elsewhere (issue 30, finding 3):
- `write_atomic`: the temporary is created with O_CREAT|O_EXCL|O_NOFOLLOW (a stale one, file or link,
  is unlinked first: unlinking a link removes the link, never its target), then `os.replace`d onto the
  name, which replaces a link there by the regular file instead of writing through it;
- `append`: O_APPEND|O_NOFOLLOW; a link at the name is a RunDirError (one line, exit 2);
- `read_bytes`: O_NOFOLLOW, for a reader that rewrites what it read (metrics.jsonl cut back on resume).
Readers that print what they find (`logs`, `doctor`, `report`) call `check_inside`: a file that is a link
leading out of the run directory is refused (one line) instead of shown.

Only the last component is protected; hpctrain creates no links, so none of its own writes is refused.
Torch-free: the runtime, the launcher and the diagnose stage all write or read through these.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterable, Optional

from hpctrain.rundir.read import RunDirError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _link_error(path: str | os.PathLike[str]) -> RunDirError:
    return RunDirError(f"{os.fspath(path)}: is a symbolic link; hpctrain writes only regular files in a run "
                       "directory (remove the link)")


def create_exclusive(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """A descriptor of a new file at `path`, opened for writing; a stale file or link there is unlinked
    first (never followed). OSError when the name is a folder or cannot be created."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    for _ in range(3):
        try:
            return os.open(path, flags, mode)
        except FileExistsError:
            try:
                os.unlink(path)  # a leftover of a killed writer, or a planted link: the link goes, not its target
            except FileNotFoundError:
                pass
    return os.open(path, flags, mode)  # someone keeps re-creating it: let O_EXCL say so


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, tmp: Optional[str] = None,
                 fsync: bool = False) -> None:
    """Write `data` to `path` atomically (readers see the old or the new file, never half of one)
    through `tmp` (default: PATH.tmp) without following a symbolic link at either name."""
    target = os.fspath(path)
    temporary = tmp if tmp is not None else f"{target}.tmp"
    body = data.encode("utf-8") if isinstance(data, str) else data
    fd = create_exclusive(temporary)
    try:
        with os.fdopen(fd, "wb", closefd=True) as handle:
            fd = -1
            handle.write(body)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary, target)  # rename(2) replaces a link at `target` itself: nothing outside is touched
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def open_append(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """A descriptor for appending to `path` (created when missing); RunDirError when it is a link."""
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise


def append(path: str | os.PathLike[str], data: bytes) -> None:
    """`data` appended with one O_APPEND write (concurrent writers never interleave within it)."""
    fd = open_append(path)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes, not through a link (RunDirError); FileNotFoundError when missing."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise
    with os.fdopen(fd, "rb", closefd=True) as handle:
        return handle.read()


def leaves(run_dir: Path, path: Path) -> Optional[str]:
    """Where `path` really is when a symbolic link takes it out of `run_dir`, else None."""
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(run_dir))
    return None if real == root or root in real.parents else str(real)


def check_inside(run_dir: Path, paths: Iterable[Path]) -> None:
    """RunDirError for the first of `paths` (files of run_dir a reader is about to show) that a symbolic
    link leads out of the run directory."""
    for path in paths:
        where = leaves(run_dir, path)
        if where is not None:
            raise RunDirError(f"{path}: is a symbolic link to {where}, outside the run directory; hpctrain shows "
                              "only files inside it (remove the link)")
