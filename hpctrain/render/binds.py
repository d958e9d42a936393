"""The folders a container job must see: container.binds plus the run directory, the data and the checkpoints.

Both the rendered script (context.py) and validate/submit's checks (sbatch.py's sbatch_problems) use
these, so what validate accepts is what render binds.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hpctrain.errors import RenderError

if TYPE_CHECKING:
    from hpctrain.config import Job


def _covered(path: str, binds: list[str]) -> bool:
    """Whether a bind source already is `path` or a folder above it (then it is visible in the image)."""
    sources = [b.split(":", 1)[0].rstrip("/") for b in binds]
    return any(path == src or path.startswith(src + "/") for src in sources if src)


def job_folders(job: Job, run_dir: str) -> list[tuple[str, str]]:
    """(field, absolute folder) the ranks read or write outside the image: the run directory, the folder
    of train.data, checkpoint.dir and entrypoint.script. Relative paths are left out (submit makes them absolute first)."""
    folders = [("run directory", run_dir)]
    if job.train.data != "synthetic":
        folders.append(("train.data", os.path.dirname(os.path.normpath(job.train.data))))
    if job.checkpoint.dir is not None:
        folders.append(("checkpoint.dir", os.path.normpath(job.checkpoint.dir)))
    if job.entrypoint is not None and job.entrypoint.script is not None:  # the user's program, run in the image
        folders.append(("entrypoint.script", os.path.dirname(os.path.normpath(job.entrypoint.script))))
    return [(field, path) for field, path in folders if path.startswith("/")]


def container_binds(job: Job, run_dir: str) -> list[str]:
    """container.binds, plus each folder of job_folders() that no bind already covers."""
    binds = list(job.container.binds)
    for bind in binds:
        if "," in bind:
            raise RenderError(f"container.binds: singularity splits --bind values on ',' and has no escape "
                              f"for it (got {bind!r:.80}); bind a parent folder without a comma")
    for field, path in job_folders(job, run_dir):
        if _covered(path, binds):
            continue
        if "," in path or ":" in path:
            raise RenderError(f"{field}: its folder must be bound into the container, but a --bind spec cannot "
                              f"carry ',' or ':' (got {path!r:.80}); add a parent folder to container.binds")
        binds.append(path)
    return binds
