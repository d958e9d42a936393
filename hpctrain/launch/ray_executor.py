"""The Ray executor: the job goes to a running Ray cluster through the Ray Jobs API.

    cluster.executor: ray        cluster.ray.address (or RAY_ADDRESS, else http://127.0.0.1:8265)

`submit` sends one Ray job whose entrypoint is the driver (`python -m hpctrain.launch.ray.driver`);
the driver, on the cluster, starts one worker per GPU (or CPU slot) running the same runtime entry
point as srun does, with the rendezvous (MASTER_ADDR/PORT) from Ray, and restarts a failed attempt
within restart.max_requeues (resuming from the newest checkpoint). The run directory must be visible
to the cluster's nodes at the same path, as on Slurm. Job ids are Ray submission ids.

Ray is an optional extra (`pip install 'hpctrain[ray]'`): `import ray` happens inside these functions
only, so the login path (validate, plan, render, status of other runs) never pays for it.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Optional

from hpctrain.config import Job
from hpctrain.errors import SubmissionError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
DRIVER_MODULE = "hpctrain.launch.ray.driver"
# Ray's job states -> the Slurm words status and cancel already understand.
STATES = {"PENDING": "PENDING", "RUNNING": "RUNNING", "SUCCEEDED": "COMPLETED", "FAILED": "FAILED",
          "STOPPED": "CANCELLED"}
_FORWARDED_PREFIXES = ("HPCTRAIN_",)  # the submitter's settings the ranks honour (test knobs, timeouts)


def address_of(job: Job, environ: Optional[dict[str, str]] = None) -> str:
    env = os.environ if environ is None else environ
    return job.cluster.ray.address or env.get("RAY_ADDRESS") or DEFAULT_ADDRESS


def _client(address: str) -> Any:
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise SubmissionError("cluster.executor ray: the ray package is not installed here; "
                              "pip install 'hpctrain[ray]'") from None
    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SubmissionError(f"cluster.ray.address {address}: no Ray Jobs API answers there ({first:.200}); "
                              "start the cluster with its dashboard, or set cluster.ray.address / RAY_ADDRESS") from None


def entrypoint(run_dir: Path, python: str) -> str:
    """The shell command Ray runs for the job (Ray's entrypoint is a shell string: every part is quoted)."""
    return " ".join(shlex.quote(part) for part in [python, "-u", "-m", DRIVER_MODULE, "--run-dir", str(run_dir)])


def submit(run_dir: Path, job: Job, python: str) -> tuple[str, str]:
    """Submit the driver for run_dir; return (Ray submission id, address)."""
    address = address_of(job)
    client = _client(address)
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)}
    try:
        job_id = client.submit_job(entrypoint=entrypoint(run_dir, python), runtime_env={"env_vars": env_vars},
                                   metadata={"hpctrain_run_dir": str(run_dir)})
    except Exception as exc:  # the Jobs API answers refusals as HTTP errors of several types
        raise SubmissionError(f"Ray refused the job at {address}: {str(exc).strip()[:300]}") from None
    return str(job_id), address


def job_record(job_id: str, address: str) -> tuple[str, Optional[str]]:
    """(state in Slurm's words, reason or None) of a Ray job; UNKNOWN when the cluster does not answer."""
    try:
        client = _client(address)
        info = client.get_job_info(job_id)
    except Exception as exc:  # gone cluster, forgotten job: status must still show the run directory
        return "UNKNOWN", f"Ray at {address} did not answer: {str(exc).strip()[:200]}"
    state = STATES.get(str(getattr(info.status, "value", info.status)), "UNKNOWN")
    message = info.message if state in ("FAILED", "CANCELLED") else None
    return state, message


def cancel(job_id: str, address: str) -> bool:
    """Ask Ray to stop the job (the driver stops its workers on SIGTERM). False if it had ended."""
    client = _client(address)
    try:
        return bool(client.stop_job(job_id))
    except Exception as exc:
        raise SubmissionError(f"Ray at {address} could not stop job {job_id}: {str(exc).strip()[:300]}") from None
