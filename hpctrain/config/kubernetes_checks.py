"""Cross-field checks of a volcano job: the sections it needs and the paths its pods share."""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from hpctrain.config.problem import Problem

if TYPE_CHECKING:
    from hpctrain.config.job import Job


def kubernetes_problems(job: Job) -> list[Problem]:
    k8s, out = job.kubernetes, list[Problem]()
    if job.cluster.executor != "volcano":
        return out
    if k8s is None:
        return [Problem("kubernetes", "is required with cluster.executor: volcano", None,
                        "add a kubernetes section with at least image and pvc.claim_name")]
    mount = k8s.pvc.mount_path
    if not mount.startswith("/") or ":" in mount or posixpath.normpath(mount) in ("/", "/dev", "/dev/shm"):
        out.append(Problem("kubernetes.pvc.mount_path", "must be an absolute folder other than /, /dev and "
                           "/dev/shm, without ':' (a core/v1 mountPath)", mount, "use e.g. /runs"))
    elif job.checkpoint.dir is not None and not _under(job.checkpoint.dir, mount):
        out.append(Problem("checkpoint.dir", "must be on the shared volume (kubernetes.pvc.mount_path="
                           f"{mount}): a restarted pod may land on another node", job.checkpoint.dir,
                           f"unset it (default: <run dir>/checkpoints) or put it under {mount}"))
    low, high = getattr(job.cluster, "min_nodes", None), getattr(job.cluster, "max_nodes", None)
    if low is not None and low != high:
        out.append(Problem("cluster.nodes", "a volcano job is gang-scheduled on a fixed node count (minAvailable = "
                           "replicas); a node range is elastic Slurm's", f"{low}-{high}",
                           "give one number of nodes"))
    if job.container.image is not None:
        out.append(Problem("container.image", "is a Singularity image; a volcano job runs kubernetes.image",
                           job.container.image, "unset container.image"))
    return out


def _under(path: str, folder: str) -> bool:
    path, folder = posixpath.normpath(path), posixpath.normpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")
