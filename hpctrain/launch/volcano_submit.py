"""`submit` with cluster.executor: volcano: render vcjob.yaml into the run directory, create it with kubectl.

The run directory on this machine keeps what the user submitted (job.yaml, job.resolved.yaml,
plan.json, submit/vcjob.yaml, events.jsonl); the pods' run directory is the one of the same name on
the shared volume (<kubernetes.pvc.mount_path>/<run name>), where the ranks write metrics, logs and
checkpoints. Without kubectl or a current context the manifest stays for the user to create.
"""

from __future__ import annotations

import posixpath
from typing import Any, Optional

from hpctrain.errors import ConfigError, SubmissionError
from hpctrain.launch.kubectl import Kubectl
from hpctrain.launch.rundir import append_event, write_text
from hpctrain.render.vcjob import VCJOB_FILE, render_vcjob

EXECUTOR = "volcano"


def launch_volcano(out: Any, resolved: Any, *, array: Optional[str], dry_run: bool,
                   kubectl: Optional[Kubectl] = None) -> Any:
    """Fill the Submission `out`: the manifest path, and the job id unless a dry run."""
    if array is not None:
        raise ConfigError("cluster.executor: volcano submits one Job; a sweep (job array) needs cluster.executor "
                          "slurm or local")
    run_dir = out.run_dir
    pod_dir = posixpath.join(resolved.kubernetes.pvc.mount_path, run_dir.name)
    path = run_dir / "submit" / VCJOB_FILE
    write_text(path, render_vcjob(resolved, run_dir=pod_dir))
    out.script_path = path
    if dry_run:
        append_event(run_dir, "dry_run", executor=EXECUTOR)
        return out
    kubectl = kubectl or Kubectl()
    why = kubectl.unavailable()
    if why is not None:
        append_event(run_dir, "failed", reason=why, stage="submit", executor=EXECUTOR)
        raise ConfigError(f"cluster.executor: volcano: {why}, so nothing was submitted; the manifest is {path}: "
                          "create it with `kubectl create -f` where kubectl reaches the cluster")
    try:
        out.job_id = kubectl.create(path, resolved.kubernetes.namespace)
    except SubmissionError as exc:
        append_event(run_dir, "failed", reason=str(exc), stage="submit", executor=EXECUTOR)
        raise SubmissionError(f"{exc}\n(run directory {run_dir} marked failed; manifest {path})") from None
    append_event(run_dir, "submitted", executor=EXECUTOR, job_id=out.job_id, pod_run_dir=pod_dir)
    return out
