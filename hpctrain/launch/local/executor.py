"""The local executor: the same job as processes on this machine, for a laptop, a CI box or a test.

It differs from the Slurm executor in who starts the ranks: a detached supervisor process
(`local/supervisor.py`) instead of sbatch/srun. Same run directory, same runtime entry point, same
rank variables. Job ids look like `local-<supervisor pid>` (`local-<pid>_<task>` in a sweep).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.launch.executor import Executor, Handle, Prepared, SchedulerState, TaskSpec
from hpctrain.launch.files import writing
from hpctrain.launch.local import supervisor as sup
from hpctrain.launch.rundir import write_json
from hpctrain.launch.stages import rank_argv
from hpctrain.rundir.layout import SUBMIT_DIR
from hpctrain.rundir.local_state import local_state_path, read_local_state
from hpctrain.rundir.lock import RunLock, acquire
from hpctrain.rundir.process import command_line, is_recorded_process, start_ticks
from hpctrain.rundir.safe_files import open_append

if TYPE_CHECKING:  # annotations only: `status` of a local run does not build the schema
    from hpctrain.config import Job

SUPERVISOR_MODULE = "hpctrain.launch.local.supervisor"


class LocalExecutor(Executor):
    """Starts one supervisor per submission (a job, or all tasks of a sweep)."""

    name = "local"
    supports_arrays = True  # the supervisor runs a sweep's tasks, max_parallel at a time
    # The supervisor's own live states. Its STOPPED (a stop that nothing requeued) has ended, whereas Slurm's
    # STOPPED is a live job held with SIGSTOP.
    active_states = frozenset({"PENDING", "RUNNING", "SUBMITTED"})

    def __init__(self, env: Optional[Mapping[str, str]] = None, python: Optional[str] = None) -> None:
        super().__init__(env)
        self.python = python or sys.executable

    def check(self, job: Job, *, array: Optional[str] = None) -> None:
        """The ranks run on the host (no Singularity image)."""
        if job.container.image is not None:
            raise ConfigError(f"container.image: the local executor runs on the host, not in an image (got "
                              f"{job.container.image!r}); unset container.image or use cluster.executor: slurm")

    def submit(self, run_dir: Path, resolved: Job, tasks: list[TaskSpec], prepared: Prepared, *,
               array: Optional[str] = None, max_parallel: int = 1) -> Handle:
        job_id, proc = self.start(run_dir, tasks, max_parallel)
        # Who the supervisor is, beyond its pid (which another process may have later): `cancel` checks both.
        facts = {"supervisor_start": start_ticks(proc.pid),
                 "supervisor_spec": str(run_dir / SUBMIT_DIR / sup.SPEC_FILE)}
        return Handle(job_id, facts=facts, process=proc)

    def state(self, submitted: Mapping[str, Any], jobs: Sequence[tuple[str, Path]]) -> dict[str, SchedulerState]:
        out = {}
        for job_id, run_dir in jobs:
            record = task_record(run_dir, job_id, submitted)
            out[job_id] = SchedulerState(str(record.get("state", "UNKNOWN")), record.get("reason"))
        return out

    def cancel(self, submitted: Mapping[str, Any], job_id: str, task_id: Optional[int] = None) -> bool:
        if task_id is not None:
            raise ConfigError("--task: the local executor cancels a whole sweep; drop --task")
        return cancel(job_id, submitted)

    def start(self, root: Path, tasks: list[TaskSpec], max_parallel: int = 1) -> tuple[str, subprocess.Popen[bytes]]:
        """Start the supervisor for `tasks` (task id, run dir holding job.resolved.yaml, that job); return
        (job id, supervisor process)."""
        # A single job's run directory may hold live ranks (a resume): take its lock before touching anything
        # there and hand it to the supervisor, so that no second set can start in between (RunLockedError,
        # exit 2). A sweep's task directories are new; the supervisor locks each when it starts it.
        with writing(root):
            held = acquire(tasks[0][1]) if len(tasks) == 1 and tasks[0][0] is None else None
        try:
            return self._start(root, tasks, max_parallel, held)
        finally:
            if held is not None:
                held.release()  # the supervisor holds its inherited copy

    def _start(self, root: Path, tasks: list[TaskSpec], max_parallel: int,
               held: Optional[RunLock]) -> tuple[str, subprocess.Popen[bytes]]:
        spec = {"max_parallel": max_parallel,
                # runtime.python, as in the batch script; else the interpreter running hpctrain now
                "tasks": [{"task_id": task_id, "run_dir": str(path),
                           "argv": rank_argv(path, job, job.runtime.python or self.python),
                           "world_size": job.world_size, "gpus_per_node": job.cluster.gpus_per_node,
                           "env": rank_environment(job), "lock_fd": held.fd if held is not None else None}
                          for task_id, path, job in tasks]}
        spec_path = root / SUBMIT_DIR / sup.SPEC_FILE
        with writing(root):
            write_json(spec_path, spec)
            for _, path, _ in tasks:
                write_json(local_state_path(path), {"state": "PENDING"})
            log = open(open_append(root / SUBMIT_DIR / "supervisor.log"), "ab")
        with log:
            proc = subprocess.Popen([self.python, "-m", SUPERVISOR_MODULE, str(spec_path)], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=(held.fd,) if held is not None else ())
        return f"local-{proc.pid}", proc


def rank_environment(job: Job) -> dict[str, str]:
    """What the job sets in its ranks' environment beyond the launcher's variables: the nccl section as the
    user wrote it (the batch script exports the same names; the fabric profile's defaults are for a cluster)."""
    env = {"NCCL_SOCKET_IFNAME": job.nccl.socket_ifname, "NCCL_IB_HCA": job.nccl.ib_hca, **job.nccl.env}
    return {name: str(value) for name, value in env.items() if value is not None}


def supervisor_pid(job_id: str) -> Optional[int]:
    head = job_id.split("_", 1)[0]
    return int(head[len("local-"):]) if head.startswith("local-") and head[len("local-"):].isdigit() else None


def _recorded_start(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def task_record(run_dir: Path, job_id: str, submitted: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """{state, attempt, exit_codes, reason, ...} of one local job or task, from its state file. A live
    state counts only while its supervisor lives: the recorded pid, started when recorded, running our
    supervisor module for this run (rundir/process.py); a pid that another process has now does not."""
    data = read_local_state(run_dir) or {"state": "UNKNOWN"}
    if data.get("pid"):
        pid, start = data["pid"], _recorded_start(data.get("pid_start"))
    else:  # PENDING: the supervisor has not written its record yet; the client recorded its start
        pid, start = supervisor_pid(job_id), _recorded_start((submitted or {}).get("supervisor_start"))
    if data.get("state") in ("PENDING", "RUNNING") and (
            pid is None or not is_recorded_process(pid, run_dir, start, needs=SUPERVISOR_MODULE)):
        data = {**data, "state": "FAILED", "reason": "the local supervisor process is gone"}
    return data


def cancel(job_id: str, submitted: Optional[Mapping[str, Any]] = None) -> bool:
    """SIGTERM the supervisor (it stops the ranks, then marks the tasks CANCELLED). False if it had ended,
    or if its pid now belongs to another process (nothing is signalled then)."""
    pid = supervisor_pid(job_id)
    spec = (submitted or {}).get("supervisor_spec")
    if pid is None:
        return False
    if isinstance(spec, str):
        ours = is_recorded_process(pid, Path(spec).parent.parent, _recorded_start((submitted or {}).get(
            "supervisor_start")), needs=SUPERVISOR_MODULE)
    else:  # a run submitted before the supervisor's identity was recorded: its program is all there is to check
        ours = SUPERVISOR_MODULE in (command_line(pid) or [])
    if not ours:
        return False
    os.kill(pid, signal.SIGTERM)
    return True
