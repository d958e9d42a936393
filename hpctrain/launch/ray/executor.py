"""The Ray executor: the job goes to a running Ray cluster through the Ray Jobs API.

    cluster.executor: ray        cluster.ray.address (or RAY_ADDRESS, else http://127.0.0.1:8265)

`submit` sends one Ray job whose entrypoint is the driver (`python -m hpctrain.launch.ray.driver`);
the driver, on the cluster, starts one worker per GPU (or CPU slot) running the same runtime entry
point as srun does, with the rendezvous (MASTER_ADDR/PORT) from Ray, and restarts a failed attempt
within restart.max_requeues (resuming from the newest checkpoint). The run directory must be visible
to the cluster's nodes at the same path, as on Slurm. Job ids are Ray submission ids.

A job that the head no longer knows (a new head at the address: the old one died with its job table)
or whose head does not answer is UNKNOWN at first, then FAILED with the reason RAY_HEAD_LOST_JOB once
the run directory has been quiet (no write to events.jsonl, metrics.jsonl or logs/) for NOT_KNOWN_AFTER_S
(the head answers, without the job) or NO_ANSWER_AFTER_S (no answer: the head or the way to it may come
back). A run whose runtime recorded `finished` for this submission is COMPLETED instead.
HPCTRAIN_RAY_LOST_AFTER_S sets both bounds (tests).

Ray is an optional extra (`pip install 'hpctrain[ray]'`): `import ray` happens inside these functions
only, so the login path (validate, plan, render, status of other runs) never pays for it.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from hpctrain.config import Job
from hpctrain.errors import ConfigError, SubmissionError
from hpctrain.launch.executor import Executor, Handle, Prepared, SchedulerState, TaskSpec
from hpctrain.render.context import rank_python
from hpctrain.rundir.events import FAILED, FINISHED, RAY_HEAD_LOST_JOB, SUBMITTED, read_events
from hpctrain.rundir.layout import EVENTS_FILE, METRICS_FILE

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
DRIVER_MODULE = "hpctrain.launch.ray.driver"
# Ray's job states -> the Slurm words status and cancel already understand.
STATES = {"PENDING": "PENDING", "RUNNING": "RUNNING", "SUCCEEDED": "COMPLETED", "FAILED": "FAILED",
          "STOPPED": "CANCELLED"}
NOT_KNOWN_AFTER_S = 60.0  # the head answers and has no such job: a new head (Ray keeps its job table in the GCS)
NO_ANSWER_AFTER_S = 300.0  # nothing answers at the address: the head, or only the way to it, may be down
LOST_AFTER_ENV = "HPCTRAIN_RAY_LOST_AFTER_S"
# How the head answered about a job (ask()).
KNOWN, NOT_KNOWN, NO_ANSWER = "known", "not-known", "no-answer"
_FORWARDED_PREFIXES = ("HPCTRAIN_",)  # the submitter's settings the ranks honour (test knobs, timeouts)


class RayExecutor(Executor):
    """One Ray job per run, through the Ray Jobs API; its address is recorded in the `submitted` event."""

    name = "ray"
    supports_arrays = False

    def describe(self, job: Job, *, dry_run: bool = False) -> str:
        return f"executor: ray (cluster.executor; Ray Jobs API at {address_of(job, self.env)})"

    def check(self, job: Job, *, array: Optional[str] = None) -> None:
        """The ranks run in the Ray workers' environment (no Singularity image); one Ray job, no arrays."""
        if job.container.image is not None:
            raise ConfigError(f"container.image: the ray executor runs the ranks in the Ray workers' environment, "
                              f"not in an image (got {job.container.image!r}); unset container.image (a Ray "
                              "cluster brings its own image) or use cluster.executor: slurm")
        if array is not None:
            raise ConfigError("cluster.executor: ray submits one job; a sweep (job array) needs cluster.executor "
                              "slurm or local")

    def submit(self, run_dir: Path, resolved: Job, tasks: list[TaskSpec], prepared: Prepared, *,
               array: Optional[str] = None, max_parallel: int = 1) -> Handle:
        job_id, address = submit(run_dir, resolved, rank_python(resolved))
        return Handle(job_id, facts={"address": address})  # status and cancel ask this address

    def state(self, submitted: Mapping[str, Any], jobs: Sequence[tuple[str, Path]]) -> dict[str, SchedulerState]:
        address = str(submitted.get("address") or "")
        out = {}
        for job_id, run_dir in jobs:
            state, reason, answer = ask(job_id, address)
            if answer != KNOWN:
                state, reason = settle(run_dir, reason, answer, lost_after(self.env))
            out[job_id] = SchedulerState(state, reason)
        return out

    def cancel(self, submitted: Mapping[str, Any], job_id: str, task_id: Optional[int] = None) -> bool:
        if task_id is not None:
            raise ConfigError("--task: a Ray run is a single job; drop --task")
        return cancel(job_id, str(submitted.get("address") or ""))


# A head that has just started answers the Jobs API before its job agent runs: the submission is refused
# with this text (HTTP 500) until the agent registers. Waited for, up to AGENT_WAIT_S, instead of exit 3.
_AGENT_STARTING = "No available agent to submit job"
AGENT_WAIT_S = 60.0


def address_of(job: Job, environ: Optional[Mapping[str, str]] = None) -> str:
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
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            job_id = client.submit_job(entrypoint=entrypoint(run_dir, python), runtime_env={"env_vars": env_vars},
                                       metadata={"hpctrain_run_dir": str(run_dir)})
            return str(job_id), address
        except Exception as exc:  # the Jobs API answers refusals as HTTP errors of several types
            text = str(exc).strip()
            if _AGENT_STARTING in text and time.monotonic() < deadline:
                time.sleep(1.0)  # a head started seconds ago: its job agent is not up yet
                continue
            raise SubmissionError(f"Ray refused the job at {address}: {text[:300]}") from None


def job_record(job_id: str, address: str) -> tuple[str, Optional[str]]:
    """(state in Slurm's words, reason or None) of a Ray job; UNKNOWN when the cluster does not answer."""
    state, reason, _ = ask(job_id, address)
    return state, reason


def ask(job_id: str, address: str) -> tuple[str, Optional[str], str]:
    """(state, reason, KNOWN / NOT_KNOWN / NO_ANSWER): the head's answer about job_id. NOT_KNOWN only when
    the head answers and its list of jobs lacks job_id (not read from an error's wording)."""
    try:
        client = _client(address)
    except Exception as exc:
        return "UNKNOWN", f"Ray at {address} did not answer: {_first(exc)}", NO_ANSWER
    try:
        info = client.get_job_info(job_id)
    except Exception as exc:  # a forgotten job, or a head that stopped answering in between
        try:
            known = any(getattr(j, "submission_id", None) == job_id for j in client.list_jobs())
        except Exception:
            return "UNKNOWN", f"Ray at {address} did not answer: {_first(exc)}", NO_ANSWER
        if not known:
            return "UNKNOWN", f"the Ray head at {address} does not know job {job_id}", NOT_KNOWN
        return "UNKNOWN", f"Ray at {address} did not answer: {_first(exc)}", NO_ANSWER
    state = STATES.get(str(getattr(info.status, "value", info.status)), "UNKNOWN")
    message = info.message if state in ("FAILED", "CANCELLED") else None
    return state, message, KNOWN


def _first(exc: BaseException) -> str:
    return str(exc).strip()[:200] or type(exc).__name__


def lost_after(environ: Optional[Mapping[str, str]] = None) -> tuple[float, float]:
    """(NOT_KNOWN bound, NO_ANSWER bound) in seconds; HPCTRAIN_RAY_LOST_AFTER_S sets both."""
    raw = (os.environ if environ is None else environ).get(LOST_AFTER_ENV)
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        value = None
    if value is None or not 0 <= value < 1e9:
        return NOT_KNOWN_AFTER_S, NO_ANSWER_AFTER_S
    return value, value


def last_sign_of_life(run_dir: Path) -> Optional[float]:
    """The newest modification time (epoch s) of what a live run writes: events.jsonl (the submit, the
    driver, the runtime), metrics.jsonl and its logs; None when none of them exists."""
    paths = [run_dir / EVENTS_FILE, run_dir / METRICS_FILE]
    try:
        paths += [p for p in (run_dir / "logs").iterdir()]
    except OSError:
        pass
    times = []
    for path in paths:
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            pass
    return max(times) if times else None


def settle(run_dir: Path, reason: Optional[str], answer: str, bounds: tuple[float, float],
           now: Optional[float] = None) -> tuple[str, Optional[str]]:
    """The state of a job its head does not know (NOT_KNOWN) or does not answer for (NO_ANSWER): UNKNOWN
    while the run directory was written less than the bound ago, then FAILED (RAY_HEAD_LOST_JOB), or
    COMPLETED when the runtime recorded `finished` after the last submission."""
    bound = bounds[0] if answer == NOT_KNOWN else bounds[1]
    seen = last_sign_of_life(run_dir)
    quiet = (time.time() if now is None else now) - (seen if seen is not None else 0.0)
    if quiet < bound:
        return "UNKNOWN", f"{reason}; FAILED if nothing changes in the run for {bound - quiet:.0f} s more"
    try:
        events = read_events(run_dir)
    except Exception:  # a damaged events file: the head's answer alone decides
        events = []
    starts = [i for i, e in enumerate(events) if e.get("event") == SUBMITTED]
    current = events[starts[-1]:] if starts else events
    if any(e.get("event") == FINISHED for e in current):
        return "COMPLETED", None
    recorded = [e.get("reason") for e in current if e.get("event") == FAILED and isinstance(e.get("reason"), str)]
    detail = f"; the run recorded: {recorded[-1]}" if recorded else ""
    return "FAILED", f"{RAY_HEAD_LOST_JOB} ({reason}, nothing written to the run for {quiet:.0f} s{detail})"


def cancel(job_id: str, address: str) -> bool:
    """Ask Ray to stop the job (the driver stops its workers on SIGTERM). False if it had ended."""
    client = _client(address)
    try:
        return bool(client.stop_job(job_id))
    except Exception as exc:
        raise SubmissionError(f"Ray at {address} could not stop job {job_id}: {str(exc).strip()[:300]}") from None
