"""Files the user names: bounded reads of regular files, and writes to output paths with one-line errors.

Every stage reads a file the user points at (job.yaml, topology files) or writes where `-o` says
(render, report, schema, data prepare). Both go wrong the same ways: a FIFO or /dev/zero instead of a
file (a read that blocks forever or never ends), a path blocked by a file, a folder without write
permission, a full disk. Here each becomes a ConfigError (exit 2) that names the path and the fix.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Iterator

from hpctrain.errors import ConfigError


def read_regular_file(path: str, limit_bytes: int, label: str, *, larger: str = "refuse") -> bytes:
    """At most limit_bytes of the regular file at path; ConfigError for anything else.

    larger="return": a file over the limit is not refused here; its first limit_bytes + 1 bytes are
    returned, for a caller that words the size error itself.

    The file is opened non-blocking and checked with fstat on the open descriptor, so a FIFO is refused
    without waiting for a writer and the check holds for the file actually read. `label` starts each
    message (e.g. "cluster.topology.nvidia_smi" or "job.yaml").
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {path!r:.200} ({exc.strerror}); check the path") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket or special file")
            raise ConfigError(f"{label}: {path!r:.200} is {kind}, not a regular file; give the path of a saved file")
        with os.fdopen(fd, "rb", closefd=True) as handle:
            fd = -1
            data = handle.read(limit_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {path!r:.200} ({exc.strerror}); check the path") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit_bytes and larger == "refuse":
        raise ConfigError(f"{label}: {path!r:.200} is larger than {limit_bytes} bytes; give the saved file itself")
    return data


@contextlib.contextmanager
def writing_output(option: str, path: object) -> Iterator[None]:
    """Around the writes to a user-named output: an OSError becomes `OPTION PATH: cannot write ...`.

    Wrap only the writes: an OSError from reading inputs inside the block would be blamed on the output.
    """
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise ConfigError(f"{option} {str(path)!r:.200}: cannot write there: {reason}{where}; choose a folder you "
                          "can write to (and that no file of the same name blocks)") from None
