"""The local executor's job process: runs a job (or a sweep's tasks) as rank processes on this machine.

    python -m hpctrain.launch.local_supervisor RUN_DIR/submit/local-spec.json

It plays the part of Slurm for a machine without one: each task's ranks get torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and
OMP_NUM_THREADS=1, log to `logs/rank-R.attempt-A.log` (R the global rank: each process starts
in `logs/task-S.attempt-A.log`, S its slot, and the runtime moves to its rank's log once it knows its
rank, as under srun; hpctrain/rundir/ranks.py), and are stopped together when one fails
(srun --kill-on-bad-exit) or when the job is cancelled (SIGTERM, then SIGKILL after a grace
period, like scancel). At most `max_parallel` tasks run at once (sbatch --array=...%K). The state of
each task is kept in its `submit/local.json`. Imports no torch: the ranks do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hpctrain.errors import HpctrainError
from hpctrain.launch.rundir import append_event, read_json, write_json
from hpctrain.rundir.ranks import ATTEMPT_ENV, LOG_DIR_ENV, global_rank, next_attempt, rank_order_of, task_log_name

STATE_FILE = "local.json"
SPEC_FILE = "local-spec.json"
KILL_WAIT_S = 10.0  # between SIGTERM and SIGKILL, as Slurm's KillWait


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(base: dict[str, str], rank: int, world: int, per_node: int, port: int) -> dict[str, str]:
    """The environment of one local rank: torchrun's variables, no Slurm job variables."""
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
               LOCAL_WORLD_SIZE=str(min(per_node, world)), GROUP_RANK=str(rank // per_node),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@dataclass
class Task:
    """One job (or sweep task): its ranks and their exit codes."""

    run_dir: Path
    world_size: int
    gpus_per_node: int
    argv: list[str]
    task_id: Optional[int] = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    state: str = "PENDING"
    attempt: int = 0

    def save(self, **extra: Any) -> None:
        path = self.run_dir / "submit" / STATE_FILE
        data = read_json(path) or {}
        data.update(state=self.state, pid=os.getpid(), attempt=self.attempt, task_id=self.task_id, **extra)
        write_json(path, data)

    def start(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.attempt = next_attempt(logs)
        port = free_port()
        for slot in range(self.world_size):
            # RANK is the slot, as SLURM_PROCID is under srun: the runtime maps it through placement.rank_order.
            env = rank_env(dict(os.environ), slot, self.world_size, self.gpus_per_node, port)
            env.update({LOG_DIR_ENV: str(logs), ATTEMPT_ENV: str(self.attempt)})
            with open(logs / task_log_name(slot, self.attempt), "ab") as log:
                self.procs.append(subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                                   stderr=subprocess.STDOUT, env=env, cwd=self.run_dir))
        self.state = "RUNNING"
        self.save(start_time=time.time(), hosts=[socket.gethostname()])

    def poll(self) -> bool:
        """Check the ranks; stop them all when one failed. True once the task has ended."""
        codes = [p.poll() for p in self.procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            self.stop()
            slot, code = failed[0]
            self.finish("FAILED", f"rank {self.rank_of(slot)} exited with code {code}")
            return True
        if all(c == 0 for c in codes):
            self.finish("COMPLETED", None)
            return True
        return False

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
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + KILL_WAIT_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def finish(self, state: str, reason: Optional[str]) -> None:
        self.state = state
        codes = [p.returncode for p in self.procs]
        self.save(end_time=time.time(), exit_codes=codes, reason=reason)
        # The executor's record (what sacct is to a Slurm job); the runtime logs its own failures.
        append_event(self.run_dir, "ended", state=state, reason=reason, exit_codes=codes, attempt=self.attempt,
                     executor="local")


class Supervisor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.tasks = [Task(Path(t["run_dir"]), t["world_size"], t["gpus_per_node"], t["argv"], t.get("task_id"))
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


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    supervisor = Supervisor(spec)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    signal.signal(signal.SIGINT, supervisor.on_signal)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
