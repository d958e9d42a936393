"""The command of every pod of a Volcano Job: start one rank per GPU of the pod, supervise them.

    python3 -m hpctrain.launch.volcano.pod --run-dir DIR --gpus N

What srun is to a Slurm job: it reads the pod's place from Volcano's environment
(hpctrain/rundir/volcano.py: node rank from VC_TASK_INDEX, the master from the svc plugin's hosts),
writes the resolved job the manifest carries (HPCTRAIN_RESOLVED_JOB) to DIR/job.resolved.yaml, and
starts N processes of `python -m hpctrain.runtime` with torchrun's variables (RANK = slot =
node_rank * N + local rank; the runtime maps it through placement.rank_order). Each logs to
DIR/logs/task-S.attempt-A.log until the runtime moves to its rank's log, as under srun.

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
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.rundir.layout import LOGS_DIR, RESOLVED_FILE
from hpctrain.rundir.ranks import ATTEMPT_ENV, LOG_DIR_ENV, task_log_name
from hpctrain.rundir.volcano import JOB_TEXT_ENV, PodRendezvous, pod_attempt, pod_rendezvous

PROG = "python -m hpctrain.launch.volcano.pod"
RUNTIME_MODULE = "hpctrain.runtime"
KILL_WAIT_S = 10.0  # between SIGTERM and SIGKILL when the other ranks are stopped
SIGTERM_EXIT = 128 + signal.SIGTERM


def rank_environment(base: Mapping[str, str], pod: PodRendezvous, local_rank: int, gpus: int, log_dir: str,
                     attempt: int) -> dict[str, str]:
    """One rank's environment: the pod's, plus torchrun's variables for this GPU."""
    env = dict(base)
    env.pop(JOB_TEXT_ENV, None)  # the ranks read the file; no need to carry the text in every environ
    env.update(RANK=str(pod.node_rank * gpus + local_rank), WORLD_SIZE=str(pod.nodes * gpus),
               LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(gpus), GROUP_RANK=str(pod.node_rank),
               MASTER_ADDR=pod.master_addr, MASTER_PORT=str(pod.master_port), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({LOG_DIR_ENV: log_dir, ATTEMPT_ENV: str(attempt)})
    return env


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
    tmp = path.with_name(f".{RESOLVED_FILE}.{os.getpid()}.{os.uname().nodename}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Pod:
    """The ranks of this pod."""

    def __init__(self, argv: list[str], gpus: int) -> None:
        self.argv, self.gpus = argv, gpus
        self.procs: list[subprocess.Popen[bytes]] = []
        self.terminated = False

    def start(self, run_dir: Path, pod: PodRendezvous) -> int:
        logs = run_dir / LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        attempt = pod_attempt(logs, pod.node_rank * self.gpus)
        for local in range(self.gpus):
            slot = pod.node_rank * self.gpus + local
            env = rank_environment(os.environ, pod, local, self.gpus, str(logs), attempt)
            with open(logs / task_log_name(slot, attempt), "ab") as log:
                self.procs.append(subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                                   stderr=subprocess.STDOUT, env=env, cwd=run_dir))
        return attempt

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = True
        self.signal_all(signal.SIGTERM)

    def signal_all(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop(self) -> None:
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + KILL_WAIT_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def wait(self) -> int:
        """0 when every rank exited 0, else the first failure's code (the others are stopped)."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and not self.terminated:
                self.stop()
                return failed[0] if failed[0] > 0 else 128 - failed[0]
            if all(c is not None for c in codes):
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
    except (ConfigError, OSError) as exc:
        for line in str(exc).splitlines():
            print(f"{PROG}: {line}", file=sys.stderr, flush=True)
        return 2
    argv_ranks = [sys.executable, "-m", RUNTIME_MODULE, "--job", str(run_dir / RESOLVED_FILE),
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
