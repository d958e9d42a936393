"""Checkpoint files and failures: what went wrong in a save, in words, and the fsyncs and deletions
that make a checkpoint durable or give its space back (used by checkpointer.py's save and finalize)."""

from __future__ import annotations

import errno
import os
import shutil

from torch.distributed.checkpoint.api import CheckpointException


def _os_error(exc: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError behind a failure, also inside DCP's CheckpointException (one per failed rank)."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            found = _os_error(failure[0] if isinstance(failure, tuple) else failure, depth + 1)
            if found is not None:
                return found
    return _os_error(exc.__cause__ or exc.__context__, depth + 1)


# A file system with less than this free when a save failed without an OSError is full: torch's zip writer
# (torch.save, the rng files) checks its own position after a short write and raises its own RuntimeError
# ("[enforce fail at inline_container.cc] unexpected pos ..."), so ENOSPC never reaches the caller.
FULL_FREE_BYTES = 1 << 20


def _full(folder: str | None) -> bool:
    if folder is None:
        return False
    try:
        return shutil.disk_usage(folder).free < FULL_FREE_BYTES
    except OSError:
        return False


def describe_failure(exc: BaseException, folder: str | None = None) -> str:
    """What went wrong in a save, in words (not `CheckpointException ranks:dict_keys([1])`); `folder`, where the
    save wrote: a failure with no OSError behind it on a file system that is full says so too."""
    os_error = _os_error(exc)
    if os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device" if os_error.errno == errno.ENOSPC else "disk quota exceeded"
    if os_error is None and _full(folder):
        return "no space left on device"
    if os_error is not None:
        where = f" ({os_error.filename})" if os_error.filename else ""
        return f"{os_error.strerror or os_error}{where}"
    if isinstance(exc, CheckpointException):
        inner = [f[0] for f in exc.failures.values() if isinstance(f, tuple)]
        exc = inner[0] if inner else exc
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def remove_all(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # fsync through any descriptor writes the file's data
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
