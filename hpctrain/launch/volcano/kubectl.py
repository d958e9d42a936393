"""Every kubectl call of the volcano executor, behind one small wrapper (as slurm/commands.py is for Slurm).

The job id of a Volcano Job is `<namespace>/<name>`. kubectl is run with an argv list (never a
shell); a missing kubectl or one without a current context is the user's setup (exit 2) and leaves
the rendered manifest for them to create; a refusal by the API server is the scheduler's (exit 3).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpctrain.errors import ConfigError, SubmissionError

TIMEOUT_S = 60.0
RESOURCE = "jobs.batch.volcano.sh"  # the CRD's plural.group: unambiguous next to batch/v1 Jobs
JOB_NAME_LABEL = "volcano.sh/job-name"  # Volcano labels each pod with its Job's name


def split_job_id(job_id: str) -> tuple[str, str]:
    namespace, _, name = job_id.partition("/")
    if not namespace or not name:
        raise ConfigError(f"job id {job_id!r}: a volcano job id is <namespace>/<name>")
    return namespace, name


@dataclass
class Kubectl:
    """kubectl with a fixed environment (tests put a stub kubectl first on PATH)."""

    env: Optional[Mapping[str, str]] = None

    def _path(self) -> Optional[str]:
        env = os.environ if self.env is None else self.env
        return shutil.which("kubectl", path=env.get("PATH"))

    def _run(self, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        program = self._path()
        if program is None:
            raise ConfigError("cluster.executor: volcano needs `kubectl` but it is not on PATH")
        try:
            proc = subprocess.run([program, *args], capture_output=True, text=True, check=False, timeout=TIMEOUT_S,
                                  env=None if self.env is None else dict(self.env))
        except subprocess.TimeoutExpired:
            raise SubmissionError(f"kubectl {args[0]}: no answer within {TIMEOUT_S:.0f} s") from None
        if check and proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise SubmissionError(f"kubectl {' '.join(args[:2])} failed (exit {proc.returncode}): "
                                  f"{detail[-1] if detail else 'no message'}")
        return proc

    def unavailable(self) -> Optional[str]:
        """Why Jobs cannot be created from here (no kubectl, no current context), or None."""
        if self._path() is None:
            return "kubectl is not on PATH"
        proc = self._run(["config", "current-context"], check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            return "kubectl has no current context (kubectl config current-context)"
        return None

    def create(self, manifest: Path, namespace: str) -> str:
        """`kubectl create -f`; the job id <namespace>/<name>."""
        proc = self._run(["create", "-f", str(manifest), "--namespace", namespace, "-o", "name"])
        name = proc.stdout.strip().rsplit("/", 1)[-1]
        if not name:
            raise SubmissionError(f"kubectl create -f {manifest}: printed no Job name")
        return f"{namespace}/{name}"

    def phase(self, job_id: str) -> str:
        """The Job's phase (Pending, Running, Restarting, Completed, Failed, ...), or UNKNOWN (also without
        kubectl: `status` still shows what the local run directory knows)."""
        namespace, name = split_job_id(job_id)
        if self._path() is None:
            return "UNKNOWN"
        proc = self._run(["get", RESOURCE, name, "--namespace", namespace, "-o", "jsonpath={.status.state.phase}"],
                         check=False)
        return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "UNKNOWN"

    def delete(self, job_id: str) -> None:
        namespace, name = split_job_id(job_id)
        self._run(["delete", RESOURCE, name, "--namespace", namespace, "--wait=false"])

    def logs(self, job_id: str) -> str:
        """Every pod's container output (the pod launchers' lines; the ranks log to the run directory)."""
        namespace, name = split_job_id(job_id)
        return self._run(["logs", "--namespace", namespace, "--selector", f"{JOB_NAME_LABEL}={name}",
                          "--prefix", "--all-containers", "--tail=-1"]).stdout


# Volcano's phases (batch/v1alpha1 JobPhase) in the words `hpctrain status` uses for Slurm's states.
PHASE_STATES = {"Pending": "PENDING", "Running": "RUNNING", "Restarting": "REQUEUED", "Completing": "COMPLETING",
                "Completed": "COMPLETED", "Aborting": "CANCELLED", "Aborted": "CANCELLED",
                "Terminating": "CANCELLED", "Terminated": "CANCELLED", "Failed": "FAILED", "UNKNOWN": "UNKNOWN"}
