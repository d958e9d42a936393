"""The one wrapper through which hpctrain calls sbatch, squeue, sacct, scontrol and scancel.

Every call has a timeout, transient controller errors ("Socket timed out", submitit issue 1659)
are retried a bounded number of times with exponential backoff, and a refusal becomes a
SubmissionError (exit 3) carrying Slurm's own message. Parsing lives in `parsers`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from hpctrain.errors import ConfigError, SubmissionError
from hpctrain.launch.slurm import parsers
from hpctrain.launch.slurm.parsers import JobRecord

SLURM_PROGRAMS = ("sbatch", "squeue", "sacct", "scontrol", "scancel")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a transient failure."""

    attempts: int = 4  # first try included
    first_delay_s: float = 0.5
    factor: float = 2.0
    timeout_s: float = 30.0  # per call

    def delays_s(self) -> list[float]:
        return [self.first_delay_s * self.factor ** k for k in range(self.attempts - 1)]


class SlurmCommands:
    """Runs Slurm client programs. `runner` is subprocess.run-compatible (tests inject faults)."""

    def __init__(self, retry: RetryPolicy = RetryPolicy(), env: Optional[dict[str, str]] = None,
                 runner: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.retry = retry
        self.env = env
        self._runner = runner
        self._sleep = sleep

    # ---- the one place commands run -----------------------------------------------------------
    def run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run argv; retry transient errors; on failure raise SubmissionError with Slurm's words."""
        program = argv[0]
        if shutil.which(program, path=(self.env or os.environ).get("PATH")) is None:
            raise missing_program_error(program)
        delays = self.retry.delays_s()
        for attempt in range(self.retry.attempts):
            try:
                result = self._runner(list(argv), capture_output=True, text=True, env=self.env,
                                      timeout=self.retry.timeout_s, check=False, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                result = subprocess.CompletedProcess(list(argv), 1, "", f"{program}: error: Socket timed out "
                                                     f"(no answer in {self.retry.timeout_s:g} s)")
            if result.returncode == 0 or not parsers.is_transient(result.stderr):
                break
            if attempt < len(delays):
                self._sleep(delays[attempt])
        if check and result.returncode != 0:
            tries = f" (after {self.retry.attempts} tries)" if parsers.is_transient(result.stderr) else ""
            raise SubmissionError(f"{program} failed{tries}: {parsers.slurm_error_message(result.stderr)}")
        return result

    # ---- commands ------------------------------------------------------------------------------
    def sbatch(self, script_path: str, *extra: str) -> str:
        """Submit a batch script file; return the job id."""
        result = self.run(["sbatch", "--parsable", *extra, script_path])
        try:
            return parsers.parse_sbatch_parsable(result.stdout)
        except ValueError as exc:
            raise SubmissionError(f"sbatch: {exc}") from None

    def squeue(self, job_ids: Iterable[str]) -> list[JobRecord]:
        """Live jobs (one record per array task); jobs slurmctld has forgotten are absent."""
        ids = ",".join(job_ids)
        if not ids:
            return []
        result = self.run(["squeue", "-h", "-r", "-j", ids, "-o", "%i|%T|%N|%r"], check=False)
        return parsers.parse_squeue(result.stdout) if result.returncode == 0 else []

    def scontrol_jobs(self, job_id: str) -> list[JobRecord]:
        """slurmctld's view (with restart counts), or [] once it has forgotten the job."""
        result = self.run(["scontrol", "show", "job", "-o", job_id], check=False)
        return parsers.parse_scontrol_jobs(result.stdout) if result.returncode == 0 else []

    def sacct(self, job_ids: Iterable[str]) -> list[JobRecord]:
        """The accounting database's view (lags a few seconds; keeps finished jobs)."""
        ids = ",".join(job_ids)
        if not ids:
            return []
        result = self.run(["sacct", "-n", "-P", "-X", "--duplicates", "-j", ids,
                           "-o", "JobID,State,ExitCode,NodeList"], check=False)
        return parsers.parse_sacct(result.stdout) if result.returncode == 0 else []

    def jobs(self, job_id: str) -> list[JobRecord]:
        """Best view of a job (or all tasks of an array): scontrol, completed by sacct."""
        live = {r.job_id: r for r in self.scontrol_jobs(job_id)}
        if live and all(r.state in parsers.ACTIVE_STATES for r in live.values()):
            return list(live.values())
        for record in self.sacct([job_id]):
            known = live.get(record.job_id)
            if known is None:
                live[record.job_id] = record
            elif known.restarts is None:
                live[record.job_id] = JobRecord(**{**known.__dict__, "restarts": record.restarts})
        return sorted(live.values(), key=lambda r: (r.array_task_id or 0, r.job_id))

    def scancel(self, job_id: str) -> None:
        self.run(["scancel", job_id])


def missing_program_error(program: str) -> ConfigError:
    """Executor slurm but no Slurm client here: a user (or PATH) problem, exit 2."""
    return ConfigError(f"cluster.executor: slurm needs `{program}` but it is not on PATH (got PATH="
                       f"{os.environ.get('PATH', '')!r}); run on a Slurm login node, load the Slurm module, or set "
                       "cluster.executor: local (or auto) to run on this machine")


def sbatch_available(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Path of sbatch on PATH, or None."""
    return shutil.which("sbatch", path=(env or os.environ).get("PATH"))


def job_query() -> Optional[Callable[[str], list[JobRecord]]]:
    """job id -> Slurm's records of it (for the doctor), when sbatch is on PATH; else None."""
    if sbatch_available() is None:
        return None
    return SlurmCommands(RetryPolicy(attempts=2, timeout_s=10.0)).jobs
