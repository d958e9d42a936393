"""Make a job's relative paths absolute before it leaves the login node.

The ranks run in other working directories (the run dir, a compute node's $HOME), so a relative
`train.data` or `checkpoint.dir` would point somewhere else there. Paths are taken relative to
where the user ran the command, like every shell tool (and like `--set` values are typed).
"""

from __future__ import annotations

import os

from hpctrain.config.job import Job


def _absolute(path: str | None, base: str) -> str | None:
    if path is None:
        return None
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def absolute_paths(job: Job, base: str | None = None) -> Job:
    """A copy of job with train.data, model.init_from, runs_dir, checkpoint.dir, container.image, topology files and
    template_dir made absolute against base (default: the current directory)."""
    base = base or os.getcwd()
    train = job.train
    if train.data != "synthetic":
        train = train.model_copy(update={"data": _absolute(train.data, base)})
    topology = job.cluster.topology.model_copy(update={
        "nvidia_smi": _absolute(job.cluster.topology.nvidia_smi, base),
        "slurm_topology": _absolute(job.cluster.topology.slurm_topology, base),
    })
    return job.model_copy(update={
        "runs_dir": _absolute(job.runs_dir, base),
        "template_dir": _absolute(job.template_dir, base),
        "train": train,
        "model": job.model.model_copy(update={"init_from": _absolute(job.model.init_from, base)}),
        "checkpoint": job.checkpoint.model_copy(update={"dir": _absolute(job.checkpoint.dir, base)}),
        "container": job.container.model_copy(update={"image": _absolute(job.container.image, base)}),
        "cluster": job.cluster.model_copy(update={"topology": topology}),
    })
