"""One node's ranks as one group: their environment, their logs, poll, stop together, die with the parent.

What srun is to a Slurm job step, for the launchers that start the ranks themselves: the local
supervisor (launch/local/supervisor.py: every rank of a job on this machine), the Volcano pod entry
(launch/volcano/pod.py: one rank per GPU of the pod) and the Ray driver's workers (launch/ray/driver.py:
one rank per actor). Each keeps only what is its own (where the rendezvous comes from, what a failure
means for its scheduler).

- environment: torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
  MASTER_ADDR, MASTER_PORT), OMP_NUM_THREADS, PYTHONUNBUFFERED, no Slurm job variables, and where the
  rank logs (HPCTRAIN_LOG_DIR, HPCTRAIN_ATTEMPT). RANK is the slot, as SLURM_PROCID is under srun: the
  runtime maps it to its global rank through placement.rank_order;
- logs: each process starts in logs/task-S.attempt-A.log and the runtime moves to its global rank's
  logs/rank-R.attempt-A.log once it knows it (hpctrain/rundir/ranks.py);
- stop: on the first failure the others are stopped (srun --kill-on-bad-exit): SIGTERM, then SIGKILL
  after a grace (Slurm's KillWait), every process reaped;
- parent death: each rank gets PR_SET_PDEATHSIG=SIGKILL (Linux), so a killed launcher leaves no orphans
  training in the run directory.
Imports no torch: the ranks do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpctrain.rundir.ranks import ATTEMPT_ENV, LOG_DIR_ENV, task_log_name
from hpctrain.rundir.safe_files import open_append

KILL_WAIT_S = 10.0  # between SIGTERM and SIGKILL, as Slurm's KillWait
POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits: torchrun's variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    master_addr: str
    master_port: int

    def variables(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.group_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def block_place(slot: int, world_size: int, per_node: int, master_addr: str, master_port: int) -> RankPlace:
    """The place of `slot` under block distribution (srun's --distribution=block): node = slot // per_node."""
    return RankPlace(rank=slot, world_size=world_size, local_rank=slot % per_node,
                     local_world_size=min(per_node, world_size), group_rank=slot // per_node,
                     master_addr=master_addr, master_port=master_port)


def rank_env(base: Mapping[str, str], place: RankPlace, *, log_dir: str, attempt: int,
             extra: Optional[Mapping[str, str]] = None, omp_threads: Optional[int] = 1,
             drop: Sequence[str] = ()) -> dict[str, str]:
    """One rank's environment: `base` without Slurm's job variables (SLURM_CONF stays) and `drop`, then
    `extra` (nccl.env, what the batch script exports on Slurm), then torchrun's variables and the log's.

    omp_threads: OMP_NUM_THREADS (None: keep base's, else 1).
    """
    env = {k: v for k, v in base.items() if (not k.startswith("SLURM_") or k == "SLURM_CONF") and k not in drop}
    env.update(extra or {})
    env.update(place.variables())
    if omp_threads is None:
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env["OMP_NUM_THREADS"] = str(max(1, omp_threads))
    env.update({"PYTHONUNBUFFERED": "1", LOG_DIR_ENV: log_dir, ATTEMPT_ENV: str(attempt)})
    return env


def die_with_parent() -> Optional[Callable[[], None]]:
    """A preexec_fn that makes a rank die with the process that started it (Linux PR_SET_PDEATHSIG), else None.

    Without it a SIGKILLed launcher leaves its ranks training as orphans that nobody can cancel, and a
    resume would start a second set in the same run directory. SIGKILL, not SIGTERM: with the launcher
    gone nobody would escalate if a rank stopped in a collective ignored the softer signal; checkpoints
    are written to step-N.partial/ and renamed, so a kill never leaves a half one.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class RankGroup:
    """The processes of one launcher's ranks, started and stopped together."""

    def __init__(self, argv: Sequence[str], *, cwd: Path, log_dir: Path, attempt: int,
                 kill_wait_s: float = KILL_WAIT_S, pass_fds: Sequence[int] = ()) -> None:
        self.argv, self.cwd, self.log_dir, self.attempt = list(argv), cwd, log_dir, attempt
        self.kill_wait_s, self.pass_fds = kill_wait_s, tuple(pass_fds)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.slots: list[int] = []
        self._preexec = die_with_parent()

    def start(self, slot: int, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        """Start the rank in `slot`, its output appended to logs/task-SLOT.attempt-A.log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(open_append(self.log_dir / task_log_name(slot, self.attempt)), "ab") as log:
            proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(env), cwd=self.cwd, pass_fds=self.pass_fds, preexec_fn=self._preexec)
        self.procs.append(proc)
        self.slots.append(slot)
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def poll(self) -> list[Optional[int]]:
        """Each rank's exit code, None while it runs."""
        return [p.poll() for p in self.procs]

    def failures(self) -> list[tuple[int, int]]:
        """(slot, exit code) of every rank that exited non-zero so far, in slot order."""
        return [(slot, code) for slot, code in zip(self.slots, self.poll()) if code not in (None, 0)]

    def running(self) -> bool:
        return any(code is None for code in self.poll())

    def succeeded(self) -> bool:
        return bool(self.procs) and all(code == 0 for code in self.poll())

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait_all(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for every rank to exit; True when they all did."""
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return not self.running()

    def stop(self, grace_s: Optional[float] = None) -> list[Optional[int]]:
        """SIGTERM to the ranks still running, SIGKILL to those left after the grace; every rank reaped."""
        self.signal_all(signal.SIGTERM)
        if not self.wait_all(self.kill_wait_s if grace_s is None else grace_s):
            self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        return self.poll()

    def watch(self, poll_s: float = 0.1, interrupted: Callable[[], bool] = lambda: False) -> Optional[tuple[int, int]]:
        """Until every rank exited 0 (None), one failed ((slot, code); the others are then stopped), or
        interrupted() (None, the ranks left running)."""
        while not interrupted():
            failed = self.failures()
            if failed:
                self.stop()
                return failed[0]
            if not self.running():
                return None
            time.sleep(poll_s)
        return None
