"""The local executor's job process: runs a job (or a sweep's tasks) as rank processes on this machine.

    python -m hpctrain.launch.local.supervisor RUN_DIR/submit/local-spec.json

It plays the part of Slurm for a machine without one: each task's ranks are one rank group
(launch/rank_group.py: torchrun's variables with OMP_NUM_THREADS=1, logs by slot then global rank and
attempt, stopped together when one fails or when the job is cancelled, SIGTERM then SIGKILL after a
grace period, like scancel; they die with this process). At most `max_parallel` tasks run at once
(sbatch --array=...%K). The state of each task is kept in its `submit/local.json`. Imports no torch: the ranks do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hpctrain.errors import HpctrainError
from hpctrain.launch.rank_group import KILL_WAIT_S, RankGroup, block_place, rank_env
from hpctrain.launch.rundir import append_event, read_events, read_json, write_json
from hpctrain.rundir.events import ENDED, FAILED, FINISHED, NOT_REQUEUED, SIGNAL, STARTED, STOPPED
from hpctrain.rundir.layout import LOGS_DIR
from hpctrain.rundir.local_state import local_state_path
from hpctrain.rundir.lock import RunLock, RunLockedError, acquire, adopt
from hpctrain.rundir.process import start_ticks
from hpctrain.rundir.ports import free_port
from hpctrain.rundir.ranks import global_rank, next_attempt, rank_order_of

SPEC_FILE = "local-spec.json"


@dataclass
class Task:
    """One job (or sweep task): its ranks and their exit codes."""

    run_dir: Path
    world_size: int
    gpus_per_node: int
    argv: list[str]
    task_id: Optional[int] = None
    env: dict[str, str] = field(default_factory=dict)  # added to each rank's environment (nccl.env)
    group: Optional[RankGroup] = None
    state: str = "PENDING"
    attempt: int = 0
    lock: Optional[RunLock] = None
    events_before: int = 0  # events.jsonl records written before this attempt started
    lock_fd: Optional[int] = None  # the run directory's lock, taken by the submitting client and inherited

    def save(self, **extra: Any) -> None:
        path = local_state_path(self.run_dir)
        data = read_json(path) or {}
        data.update(state=self.state, pid=os.getpid(), pid_start=start_ticks(os.getpid()), attempt=self.attempt,
                    task_id=self.task_id, **extra)
        try:
            write_json(path, data)
        except OSError:
            # A full disk refuses the atomic write's new file; overwriting in place frees the old blocks first,
            # so the outcome is still recorded (a reader may see a torn file for a moment: status checks the pid).
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)  # the file itself, never what a link names
            with os.fdopen(fd, "wb") as handle:
                handle.truncate(0)
                handle.write((json.dumps(data, default=str) + "\n").encode("utf-8"))

    @property
    def job_id(self) -> str:
        return f"local-{os.getpid()}" + (f"_{self.task_id}" if self.task_id is not None else "")

    def start(self) -> None:
        try:  # one live set of ranks per run directory (rundir/lock.py); the ranks inherit the lock
            self.lock = (adopt(self.run_dir, self.lock_fd, self.job_id) if self.lock_fd is not None
                         else acquire(self.run_dir, self.job_id))
        except RunLockedError as exc:
            self.finish("FAILED", str(exc))
            return
        logs = self.run_dir / LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        self.attempt = next_attempt(logs)
        self.events_before = len(read_events(self.run_dir))
        port = free_port()
        self.group = RankGroup(self.argv, cwd=self.run_dir, log_dir=logs, attempt=self.attempt,
                               pass_fds=(self.lock.fd,))  # the ranks inherit the run directory's lock
        for slot in range(self.world_size):
            place = block_place(slot, self.world_size, self.gpus_per_node, "127.0.0.1", port)
            self.group.start(slot, rank_env(os.environ, place, log_dir=str(logs), attempt=self.attempt, extra=self.env))
        self.lock.update(ranks=self.group.pids)
        self.state = "RUNNING"
        self.save(start_time=time.time(), hosts=[socket.gethostname()])

    def poll(self) -> bool:
        """Check the ranks; stop them all when one failed. True once the task has ended."""
        if self.state != "RUNNING":
            return True  # never started (the run directory was locked)
        group = self.group
        if group is None:  # cannot be RUNNING without one (start() made it)
            return True
        failed = group.failures()
        if not failed and not group.succeeded():
            return False
        stopped = self.stop_reason()
        if failed:
            if stopped:  # rank 0 said so (exit 1 after a saved stop): let the others finish their exit
                group.wait_all(KILL_WAIT_S)
            group.stop()
        if stopped and all(code == 1 for _, code in failed):
            self.finish("STOPPED", stopped)
        elif failed:
            slot, code = failed[0]
            self.finish("FAILED", f"rank {self.rank_of(slot)} exited with code {code}")
        else:
            self.finish("COMPLETED", None)
        return True

    def stop_reason(self) -> Optional[str]:
        """Why the ranks stopped early, when the runtime says so for this attempt (a `stopped` event).

        Nothing requeues a local run and no cancel was asked for (a cancel ends CANCELLED before this
        is asked): the run did not do its work, so it is STOPPED, never COMPLETED.
        """
        events = read_events(self.run_dir)[self.events_before:]
        ends = [e for e in events if e.get("event") in (STARTED, STOPPED, FINISHED, FAILED)]
        if not ends or ends[-1].get("event") != STOPPED:
            return None
        why = next((str(e["reason"]) for e in reversed(events) if e.get("event") in (NOT_REQUEUED, SIGNAL)
                    and e.get("reason")), None)
        signals = [e for e in events if e.get("event") == SIGNAL and e.get("signal")]
        why = why or (f"signal {signals[-1]['signal']}" if signals else "stopped early")
        return (f"{why}; stopped at step {ends[-1].get('step')} and nothing requeues a local run: continue with "
                f"`hpctrain resume {self.run_dir}`")

    def rank_of(self, slot: int) -> int:
        """The global rank in `slot` (for messages; the runtime itself checks the rank order)."""
        try:
            order = rank_order_of(self.run_dir)
        except HpctrainError:  # a damaged job.resolved.yaml: the rank itself will say so
            order = None
        if order is None or len(order) != self.world_size or slot >= len(order):
            return slot
        return global_rank(slot, order)

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()

    def finish(self, state: str, reason: Optional[str]) -> None:
        self.state = state
        codes = self.group.poll() if self.group is not None else []
        if self.lock is not None:  # the ranks have exited: the run directory is free again
            self.lock.release()
        self.save(end_time=time.time(), exit_codes=codes, reason=reason)
        # The executor's record (what sacct is to a Slurm job); the runtime logs its own failures.
        append_event(self.run_dir, ENDED, state=state, reason=reason, exit_codes=codes, attempt=self.attempt,
                     executor="local")


class Supervisor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.tasks = [Task(Path(t["run_dir"]), t["world_size"], t["gpus_per_node"], t["argv"], t.get("task_id"),
                           {str(k): str(v) for k, v in (t.get("env") or {}).items()}, lock_fd=t.get("lock_fd"))
                      for t in spec["tasks"]]
        self.max_parallel = max(1, int(spec.get("max_parallel", 1)))
        self.cancelled = False

    def on_signal(self, signum: int, frame: Any) -> None:
        self.cancelled = True

    def run(self) -> int:
        pending, running = list(self.tasks), list[Task]()
        while pending or running:
            if self.cancelled:
                for task in running:
                    if task.state == "RUNNING":
                        task.stop()
                        task.finish("CANCELLED", "cancelled")
                for task in pending:
                    task.finish("CANCELLED", "cancelled before it started")
                return 0
            while pending and len(running) < self.max_parallel:
                task = pending.pop(0)
                task.start()
                running.append(task)
            running = [t for t in running if not t.poll()]
            time.sleep(0.1)
        return 0 if all(t.state == "COMPLETED" for t in self.tasks) else 1


    def fail_all(self, reason: str) -> None:
        """The supervisor itself failed (a full disk, ...): stop every rank and record what can be recorded."""
        for task in self.tasks:
            if task.state in ("PENDING", "RUNNING"):
                task.stop()
                try:
                    task.finish("FAILED", reason)
                except OSError:  # the state file cannot be written: status sees the supervisor gone
                    pass


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    supervisor = Supervisor(spec)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    signal.signal(signal.SIGINT, supervisor.on_signal)
    try:
        return supervisor.run()
    except Exception as exc:  # noqa: BLE001 - never die silently with the ranks orphaned and RUNNING recorded
        reason = f"the local supervisor failed: {type(exc).__name__}: {exc}".splitlines()[0][:500]
        try:
            print(reason, file=sys.stderr, flush=True)
        except OSError:  # supervisor.log is on the full disk too
            pass
        supervisor.fail_all(reason)
        return 1


if __name__ == "__main__":
    sys.exit(main())
