"""The one Executor interface, its registry, and `choose(job, env)`: who starts a job, and how to ask about it.

A backend (`launch/local/`, `launch/slurm/`, `launch/ray/`, `launch/volcano/`) fills the same few methods:

    check(job, array)        what this backend refuses, before anything is planned or written
    prepare(run_dir, ...)    the files the submission needs (the sbatch script, the Volcano manifest)
    submit(...) -> Handle    the job id, and the facts later commands need (recorded in `submitted`)
    state(submitted, jobs)   the scheduler's view of one job, or of every task of an array
    cancel(submitted, ...)   stop it (False when it had already ended)
    logs(run_dir, submitted) where the logs are when they are not in the run directory

The command functions (submit, sweep, status, cancel, resume, logs) ask the registry for the executor
named in the run's `submitted` event and call these methods; they never compare executor names.
Backends are imported when first asked for, so that `status` of a local run never imports submitit
or ray (the registry holds their module paths).
"""

from __future__ import annotations

import abc
import importlib
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.launch.files import write_recipe, write_script
from hpctrain.launch.slurm.commands import sbatch_available
from hpctrain.rundir.states import LIVE_SLURM_STATES

if TYPE_CHECKING:  # the schema (pydantic) is not needed to ask about a run: `status` stays light
    from hpctrain.config import Job

# (array task id or None for a plain job, its run directory, its resolved job)
TaskSpec = tuple[Optional[int], Path, "Job"]
# The states in which a job is still queued or running, in Slurm's words (every backend maps to them).
ACTIVE_STATES = LIVE_SLURM_STATES | {"SUBMITTED"}


@dataclass
class Prepared:
    """What `prepare` wrote: the file the scheduler gets (or a dry run shows), and the image recipe."""

    script_path: Optional[Path] = None
    recipe_path: Optional[Path] = None


@dataclass
class Handle:
    """A submitted job: its id, the facts to record in the `submitted` event, the local supervisor."""

    job_id: str
    facts: dict[str, Any] = field(default_factory=dict)
    process: Optional[subprocess.Popen[bytes]] = field(default=None, repr=False)


@dataclass(frozen=True)
class SchedulerState:
    """One job or array task as its scheduler reports it, in Slurm's state words."""

    state: str
    reason: Optional[str] = None
    restarts: int = 0


UNKNOWN = SchedulerState("UNKNOWN")


@dataclass(frozen=True)
class RemoteLogs:
    """Logs that are not in the run directory on this machine (a note saying where they are, their text)."""

    note: str
    text: str


class SubmitRefused(Exception):
    """Raised by `Executor.submit` when nothing was submitted: `launch` records `reason` in a `failed` event
    and raises `error` (a SubmissionError from the scheduler is handled the same way without this wrapper)."""

    def __init__(self, reason: str, error: HpctrainError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class Executor(abc.ABC):
    """A way to start the job's ranks and to ask about them. Subclasses set `name` and fill the methods."""

    name: ClassVar[str]
    supports_arrays: ClassVar[bool] = False  # a sweep is ONE array: backends without arrays refuse sweeps
    artefact: ClassVar[str] = "script"  # what prepare writes, in the dry run's words ("script", "manifest")
    checks_paths_here: ClassVar[bool] = True  # data files and checkpoint dirs are checked on this machine
    active_states: ClassVar[frozenset[str]] = frozenset(ACTIVE_STATES)

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self.env = env  # the environment its client programs see (None: this process's)

    def describe(self, job: Job, *, dry_run: bool = False) -> str:
        """The sentence `submit` prints when cluster.executor names this backend; raises when it cannot run."""
        return f"executor: {self.name} (cluster.executor)"

    def sees_paths(self, *, dry_run: bool = False) -> bool:
        """Whether the job's files (train.data, checkpoint.dir) are checked on this machine before a submit, or
        a dry run of one: checks_paths_here; a backend that dry-runs for elsewhere says False then."""
        return self.checks_paths_here

    def check(self, job: Job, *, array: Optional[str] = None) -> None:
        """ConfigError for what this backend refuses in `job` (or in a sweep of it: `array` set)."""

    def check_sweep(self, points: Sequence[tuple[str, Job]], root: Path, array: str) -> None:
        """ConfigError when the sweep's points (label, resolved job) cannot share one submission."""

    def prepare(self, run_dir: Path, resolved: Job, *, array: Optional[str] = None,
                dry_run: bool = False, into: Optional[Path] = None) -> Prepared:
        """The files the submission of the job in run_dir needs, written under `into` (a scratch folder:
        `resume --dry-run` writes nothing into the run) or run_dir. A dry run shows what Slurm would get
        whatever the executor: the sbatch script and the image recipe."""
        if not dry_run:
            return Prepared()
        _, script = write_script(run_dir, resolved, array, into)
        return Prepared(script, write_recipe(run_dir, resolved, into))

    @abc.abstractmethod
    def submit(self, run_dir: Path, resolved: Job, tasks: list[TaskSpec], prepared: Prepared, *,
               array: Optional[str] = None, max_parallel: int = 1) -> Handle:
        """Submit the prepared run (a job, or a sweep's tasks as one array); SubmissionError when refused."""

    @abc.abstractmethod
    def state(self, submitted: Mapping[str, Any], jobs: Sequence[tuple[str, Path]]) -> dict[str, SchedulerState]:
        """The scheduler's view of each (job id, run directory) of one submission (a job, or array tasks),
        by job id; UNKNOWN for what the scheduler does not answer. `submitted`: the run's `submitted` event."""

    @abc.abstractmethod
    def cancel(self, submitted: Mapping[str, Any], job_id: str, task_id: Optional[int] = None) -> bool:
        """Stop the job (or one array task); False when it had already ended. ConfigError for a --task the
        backend cannot cancel on its own."""

    def logs(self, run_dir: Path, submitted: Mapping[str, Any]) -> Optional[RemoteLogs]:
        """Logs kept elsewhere than run_dir/logs (fetched from the scheduler), or None: they are in the run."""
        return None


# name -> "module:Class"; imported on first use (submitit, ray and kubectl stay off the paths that do not need them)
REGISTRY: dict[str, str] = {
    "local": "hpctrain.launch.local.executor:LocalExecutor",
    "slurm": "hpctrain.launch.slurm.executor:SlurmExecutor",
    "ray": "hpctrain.launch.ray.executor:RayExecutor",
    "volcano": "hpctrain.launch.volcano.executor:VolcanoExecutor",
}


def executor_class(name: str) -> type[Executor]:
    """The backend registered as `name`; ConfigError naming the registered ones."""
    where = REGISTRY.get(name)
    if where is None:
        raise ConfigError(f"cluster.executor: unknown executor {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    module, _, attr = where.partition(":")
    found = getattr(importlib.import_module(module), attr)
    if not (isinstance(found, type) and issubclass(found, Executor)):
        raise TypeError(f"{where} is not an Executor")
    return found


def executor_named(name: str, env: Optional[Mapping[str, str]] = None) -> Executor:
    return executor_class(name)(env)


def executor_of(submitted: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> Executor:
    """The executor that made a `submitted` event (runs from before the `executor` field were Slurm's)."""
    return executor_named(str(submitted.get("executor") or "slurm"), env)


def active_states_of(name: Optional[str]) -> frozenset[str]:
    """The live states in the vocabulary of the executor `name` (Slurm's when unknown or None)."""
    return executor_class(name).active_states if name in REGISTRY else frozenset(ACTIVE_STATES)


def choose(job: Job, env: Optional[Mapping[str, str]] = None, *, dry_run: bool = False) -> tuple[Executor, str]:
    """(the executor of cluster.executor, a sentence saying which and why).

    `auto` is slurm when sbatch is on PATH, else local. A dry run submits nothing, so it never needs
    sbatch: executor slurm renders without it.
    """
    kind = job.cluster.executor
    if kind == "auto":
        sbatch = sbatch_available(env)
        if sbatch:
            return executor_named("slurm", env), f"executor: slurm (cluster.executor auto, sbatch found at {sbatch})"
        return executor_named("local", env), "executor: local (cluster.executor auto, no sbatch on PATH)"
    executor = executor_named(kind, env)
    return executor, executor.describe(job, dry_run=dry_run)
