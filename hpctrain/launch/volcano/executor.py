"""The volcano executor: render vcjob.yaml into the run directory, create it with kubectl.

The run directory on this machine keeps what the user submitted (job.yaml, job.resolved.yaml,
plan.json, submit/vcjob.yaml, events.jsonl); the pods' run directory is the one of the same name on
the shared volume (<kubernetes.pvc.mount_path>/<run name>), where the ranks write metrics, logs and
checkpoints. Without kubectl or a current context the manifest stays for the user to create.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from hpctrain.config import Job
from hpctrain.config.kubernetes import KubernetesConfig
from hpctrain.errors import ConfigError, SubmissionError
from hpctrain.launch.executor import Executor, Handle, Prepared, RemoteLogs, SchedulerState, SubmitRefused, TaskSpec
from hpctrain.launch.rundir import write_text
from hpctrain.launch.volcano.kubectl import PHASE_STATES, Kubectl
from hpctrain.render.vcjob import VCJOB_FILE, render_vcjob
from hpctrain.rundir.layout import SUBMIT_DIR


def kubernetes_of(job: Job) -> KubernetesConfig:
    if job.kubernetes is None:  # the config stage requires the section for volcano; a job built otherwise
        raise ConfigError("kubernetes: cluster.executor volcano needs a kubernetes section (namespace, pvc, ...)")
    return job.kubernetes


def pod_run_dir(resolved: Job, run_dir: Path) -> str:
    """The run directory the pods see: <kubernetes.pvc.mount_path>/<run name>."""
    return posixpath.join(kubernetes_of(resolved).pvc.mount_path, run_dir.name)


class VolcanoExecutor(Executor):
    """One Volcano Job per run (job id `<namespace>/<name>`), created and asked about with kubectl."""

    name = "volcano"
    supports_arrays = False
    artefact = "manifest"
    checks_paths_here = False  # a volcano job's paths are the pods' (on kubernetes.pvc), not ours

    def kubectl(self) -> Kubectl:
        return Kubectl(self.env)

    def check(self, job: Job, *, array: Optional[str] = None) -> None:
        if array is not None:
            raise ConfigError("cluster.executor: volcano submits one Job; a sweep (job array) needs cluster.executor "
                              "slurm or local")

    def prepare(self, run_dir: Path, resolved: Job, *, array: Optional[str] = None,
                dry_run: bool = False, into: Optional[Path] = None) -> Prepared:
        self.check(resolved, array=array)
        path = (into or run_dir) / SUBMIT_DIR / VCJOB_FILE
        write_text(path, render_vcjob(resolved, run_dir=pod_run_dir(resolved, run_dir)))
        return Prepared(path)

    def submit(self, run_dir: Path, resolved: Job, tasks: list[TaskSpec], prepared: Prepared, *,
               array: Optional[str] = None, max_parallel: int = 1) -> Handle:
        path = prepared.script_path or run_dir / SUBMIT_DIR / VCJOB_FILE
        kubectl = self.kubectl()
        why = kubectl.unavailable()
        if why is not None:
            raise SubmitRefused(why, ConfigError(f"cluster.executor: volcano: {why}, so nothing was submitted; the "
                                                 f"manifest is {path}: create it with `kubectl create -f` where "
                                                 "kubectl reaches the cluster"))
        try:
            job_id = kubectl.create(path, kubernetes_of(resolved).namespace)
        except SubmissionError as exc:
            raise SubmitRefused(str(exc), SubmissionError(f"{exc}\n(run directory {run_dir} marked failed; "
                                                          f"manifest {path})")) from None
        return Handle(job_id, facts={"pod_run_dir": pod_run_dir(resolved, run_dir)})

    def state(self, submitted: Mapping[str, Any], jobs: Sequence[tuple[str, Path]]) -> dict[str, SchedulerState]:
        out = {}
        for job_id, _ in jobs:
            phase = self.kubectl().phase(job_id)
            out[job_id] = SchedulerState(PHASE_STATES.get(phase, phase.upper()))
        return out

    def cancel(self, submitted: Mapping[str, Any], job_id: str, task_id: Optional[int] = None) -> bool:
        if task_id is not None:
            raise ConfigError("--task: a volcano job is one Job, not a sweep; drop --task")
        self.kubectl().delete(job_id)
        return True

    def logs(self, run_dir: Path, submitted: Mapping[str, Any]) -> Optional[RemoteLogs]:
        """The pods' own output (kubectl logs); the ranks' logs are on the shared volume (<pvc>/<run>/logs)."""
        job_id = str(submitted["job_id"])
        note = (f"pod output of {job_id}; rank logs are in {submitted.get('pod_run_dir')}/logs on the shared "
                "volume")
        return RemoteLogs(note, self.kubectl().logs(job_id))
