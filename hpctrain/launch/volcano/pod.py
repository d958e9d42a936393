"""The command of every pod of a Volcano Job: start one rank per GPU of the pod, supervise them.

    python3 -m hpctrain.launch.volcano.pod --run-dir DIR --gpus N

What srun is to a Slurm job: it reads the pod's place from Volcano's environment
(hpctrain/rundir/volcano.py: node rank from VC_TASK_INDEX, the master from the svc plugin's hosts),
writes the resolved job the manifest carries (HPCTRAIN_RESOLVED_JOB) to DIR/job.resolved.yaml, and
starts N processes of `python -m hpctrain.runtime` as one rank group (launch/rank_group.py: torchrun's
variables, RANK = slot = node_rank * N + local rank, which the runtime maps through placement.rank_order;
logs in DIR/logs/task-S.attempt-A.log until the runtime moves to its rank's log, as under srun).

When a rank fails the others are stopped (srun --kill-on-bad-exit) and the pod exits with that code,
so the pod fails and the Job's PodFailed -> RestartJob policy replaces every pod; the new ranks
resume from the newest checkpoint on the shared volume. A SIGTERM (pod deleted or evicted) is passed
on, and the pod then exits 143 even if the ranks saved and exited 0: an interrupted run must not
count as a completed task (TaskCompleted -> CompleteJob would end the Job). No torch here.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.rundir.safe_files import write_atomic
from hpctrain.launch.rank_group import RankGroup, block_place, rank_env
from hpctrain.rundir.layout import LOGS_DIR, RESOLVED_FILE
from hpctrain.rundir.volcano import JOB_TEXT_ENV, PodRendezvous, pod_attempt, pod_rendezvous

PROG = "python -m hpctrain.launch.volcano.pod"
RUNTIME_MODULE = "hpctrain.runtime"
KILL_WAIT_S = 10.0  # between SIGTERM and SIGKILL when the other ranks are stopped
SIGTERM_EXIT = 128 + signal.SIGTERM


def rank_environment(base: Mapping[str, str], pod: PodRendezvous, local_rank: int, gpus: int, log_dir: str,
                     attempt: int) -> dict[str, str]:
    """One rank's environment: the pod's, plus torchrun's variables for this GPU (launch/rank_group.py)."""
    place = block_place(pod.node_rank * gpus + local_rank, pod.nodes * gpus, gpus, pod.master_addr, pod.master_port)
    # the ranks read the job file: no need to carry its text in every environ; OMP_NUM_THREADS: the pod's, else 1
    return rank_env(base, place, log_dir=log_dir, attempt=attempt, omp_threads=None, drop=(JOB_TEXT_ENV,))


def rank_module_of(resolved: Path) -> str:
    """The module the ranks run for this job file (render/context.py rank_module); the runtime when the file
    is missing or unreadable, which then says why with exit 2."""
    from hpctrain.errors import HpctrainError
    from hpctrain.render.context import ENTRYPOINT_MODULE
    from hpctrain.rundir.read import read_yaml_mapping

    try:
        data = read_yaml_mapping(resolved) or {}
    except (HpctrainError, OSError):  # the rank reads the file again and reports it as bad input
        return RUNTIME_MODULE
    return ENTRYPOINT_MODULE if data.get("entrypoint") else RUNTIME_MODULE


def write_job_text(run_dir: Path, text: Optional[str]) -> None:
    """DIR/job.resolved.yaml from the manifest's copy (each pod writes the same text atomically)."""
    path = run_dir / RESOLVED_FILE
    if text is None:
        if not path.is_file():
            raise ConfigError(f"{PROG}: {path} does not exist and {JOB_TEXT_ENV} is not set; render the Job "
                              "with `hpctrain render` (its pods carry the resolved job)")
        return
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    write_atomic(path, text, tmp=str(path.with_name(f".{RESOLVED_FILE}.{os.getpid()}.{os.uname().nodename}.tmp")))


class Pod:
    """The ranks of this pod: one rank group."""

    def __init__(self, argv: list[str], gpus: int) -> None:
        self.argv, self.gpus = argv, gpus
        self.group: Optional[RankGroup] = None
        self.terminated = False

    def start(self, run_dir: Path, pod: PodRendezvous) -> int:
        logs = run_dir / LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        attempt = pod_attempt(logs, pod.node_rank * self.gpus)
        self.group = RankGroup(self.argv, cwd=run_dir, log_dir=logs, attempt=attempt, kill_wait_s=KILL_WAIT_S)
        for local in range(self.gpus):
            env = rank_environment(os.environ, pod, local, self.gpus, str(logs), attempt)
            self.group.start(pod.node_rank * self.gpus + local, env)
        return attempt

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = True
        if self.group is not None:
            self.group.signal_all(signal.SIGTERM)

    def wait(self) -> int:
        """0 when every rank exited 0, else the first failure's code (the others are stopped)."""
        group = self.group
        if group is None:
            return 1
        while True:
            failed = [code for _, code in group.failures()]
            if failed and not self.terminated:
                group.stop()
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if not group.running():
                return SIGTERM_EXIT if self.terminated else (failed[0] if failed else 0)
            time.sleep(0.1)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description="Start and supervise one hpctrain rank per GPU of "
                                     "this Volcano pod.")
    parser.add_argument("--run-dir", required=True, metavar="DIR", help="run directory on the shared volume")
    parser.add_argument("--gpus", required=True, type=int, metavar="N", help="ranks in this pod (GPUs per node)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        if args.gpus < 1:
            raise ConfigError(f"{PROG}: --gpus {args.gpus} must be at least 1")
        pod = pod_rendezvous(os.environ)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_job_text(run_dir, os.environ.get(JOB_TEXT_ENV))
        module = rank_module_of(run_dir / RESOLVED_FILE)
    except (ConfigError, OSError) as exc:
        for line in str(exc).splitlines():
            print(f"{PROG}: {line}", file=sys.stderr, flush=True)
        return 2
    argv_ranks = [sys.executable, "-m", module, "--job", str(run_dir / RESOLVED_FILE),
                  "--run-dir", str(run_dir)]
    ranks = Pod(argv_ranks, args.gpus)
    signal.signal(signal.SIGTERM, ranks.on_sigterm)
    attempt = ranks.start(run_dir, pod)
    print(f"{PROG}: pod {pod.node_rank} of {pod.nodes}, {args.gpus} rank(s), master {pod.master_addr}:"
          f"{pod.master_port}, attempt {attempt}; logs in {run_dir / LOGS_DIR}", flush=True)
    code = ranks.wait()
    print(f"{PROG}: pod {pod.node_rank} exits {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
