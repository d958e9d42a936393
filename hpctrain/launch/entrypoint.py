"""`python -m hpctrain.launch.entrypoint --job RESOLVED.yaml --run-dir DIR`: one rank of a job's own program.

What every executor starts per rank for a job with `entrypoint:` (render/context.py rank_module; srun in
the batch script, the local supervisor's and Volcano pod's rank groups, the Ray driver's workers), in
place of `python -m hpctrain.runtime`. It runs the user's program as its child, `python SCRIPT ARGS` or
`python -m MODULE ARGS` (an argv list, never a shell), and keeps the run directory's protocol for it
(docs/architecture.md section 5):

- environment: torchrun's variables (RANK the global rank, placement.rank_order applied to the slot;
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; from srun's SLURM_PROCID,
  SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID where the launcher is srun), the devices as the launcher set
  them (the runtime's binding: every GPU of the node visible, LOCAL_RANK picks one), plus HPCTRAIN_RUN_DIR,
  HPCTRAIN_CHECKPOINT_DIR, HPCTRAIN_ATTEMPT, HPCTRAIN_TP/PP/DP and HPCTRAIN_SCRIPT_SIGNAL;
- logs: like the runtime, it moves to logs/rank-R.attempt-A.log once it knows R (the child inherits it);
- stop: on restart.signal or SIGTERM it writes the stop file (hpctrain.job.should_stop() reads it), sends
  restart.script_signal (default SIGTERM) to the program, and SIGKILLs it after restart.grace_s;
- the exit, the one rule: exit 0 after the signal = saved, requeue me (rank 0 writes HPCTRAIN_REQUEUE_MARKER
  for the exit path / the Ray driver; where nothing requeues, the local executor, rank 0 exits 1 with a
  `stopped` event, as the runtime does); exit 0 without a signal = finished; exit 2 = bad input (a line in
  HPCTRAIN_BAD_INPUT_MARKER: never requeued); anything else = a crash (the restart policy decides).
Imports no torch and runs nothing but the program the job names.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.rundir.events import FAILED, FINISHED, REQUEUE_REQUESTED, SIGNAL, STARTED, STOPPED, append_event
from hpctrain.rundir.layout import BAD_INPUT_MARKER_ENV, CHECKPOINTS_DIR
from hpctrain.rundir.ranks import ATTEMPT_ENV, LOG_DIR_ENV, global_rank, redirect_to_rank_log
from hpctrain.rundir.safe_files import append, write_atomic

if TYPE_CHECKING:
    from hpctrain.config import Job

PROG = "python -m hpctrain.launch.entrypoint"
SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "TERM": signal.SIGTERM, "INT": signal.SIGINT,
           "HUP": signal.SIGHUP}
STOP_FILE = "stop-requested"  # in the run directory: the attempt whose stop was asked (hpctrain/job.py reads it)
STOP_FILE_ENV, SCRIPT_SIGNAL_ENV = "HPCTRAIN_STOP_FILE", "HPCTRAIN_SCRIPT_SIGNAL"
REQUEUE_BY_ENV, MARKER_ENV = "HPCTRAIN_REQUEUE_BY", "HPCTRAIN_REQUEUE_MARKER"  # as runtime/requeue.py
POLL_S = 0.05


def place(environ: Mapping[str, str], gpus_per_node: int) -> dict[str, int]:
    """slot, world_size, local_rank, local_world_size, group_rank: torchrun's variables when the launcher set
    them (the rank groups, Ray), else srun's; a single process without either."""
    def num(name: str, default: int) -> int:
        value = environ.get(name, "")
        if not value:
            return default
        if not value.isdigit():
            raise ConfigError(f"environment: {name}={value!r} is not a number; start the ranks with hpctrain")
        return int(value)

    if "RANK" in environ:
        world = num("WORLD_SIZE", 1)
        return {"slot": num("RANK", 0), "world_size": world, "local_rank": num("LOCAL_RANK", 0),
                "local_world_size": num("LOCAL_WORLD_SIZE", min(world, gpus_per_node)),
                "group_rank": num("GROUP_RANK", num("RANK", 0) // max(1, gpus_per_node))}
    if "SLURM_PROCID" in environ:
        world = num("SLURM_NTASKS", 1)
        return {"slot": num("SLURM_PROCID", 0), "world_size": world, "local_rank": num("SLURM_LOCALID", 0),
                "local_world_size": min(world, gpus_per_node), "group_rank": num("SLURM_NODEID", 0)}
    return {"slot": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "group_rank": 0}


def program_argv(job: Job, values: Mapping[str, Any], python: str) -> list[str]:
    """The user's program: `python SCRIPT ARGS` or `python -m MODULE ARGS`, placeholders filled."""
    from hpctrain.config.entrypoint import fill_args

    e = job.entrypoint
    if e is None:
        raise ConfigError("entrypoint: not set in the job; the built-in model runs with python -m hpctrain.runtime")
    args = fill_args(list(e.args), dict(values))
    if e.script is not None:
        if not os.path.isfile(e.script):
            raise ConfigError(f"entrypoint.script {e.script}: no such file on {os.uname().nodename}; give a path "
                              "that the compute nodes see")
        return [python, "-u", e.script, *args]
    return [python, "-u", "-m", str(e.module), *args]


def to_rank_log(rank: int, attempt: int) -> None:
    """stdout and stderr (this process's and the program's) to logs/rank-R.attempt-A.log (rundir/ranks.py)."""
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return
    redirect_to_rank_log(folder, rank, attempt, PROG)


class Rank:
    """One rank: the program, its signals, its exit."""

    def __init__(self, job: Job, run_dir: Path, rank: int, attempt: int) -> None:
        self.job, self.run_dir, self.rank, self.attempt = job, run_dir, rank, attempt
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.signalled: Optional[str] = None
        self.kill_at: Optional[float] = None

    def event(self, name: str, **fields: Any) -> None:
        if self.rank == 0:
            try:
                append_event(self.run_dir, name, attempt=self.attempt, source="entrypoint", **fields)
            except OSError as exc:
                print(f"{PROG}: cannot record the {name} event ({exc.strerror})", file=sys.stderr, flush=True)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.signalled is None:
            self.signalled = signal.Signals(signum).name.removeprefix("SIG")  # acted on in run()'s loop

    def forward(self) -> None:
        """The stop: the stop file, the script's signal, the grace."""
        restart = self.job.restart
        try:
            write_atomic(self.run_dir / STOP_FILE, f"{self.attempt}\n")
        except OSError:
            pass  # the signal below still tells the program
        self.event(SIGNAL, signal=self.signalled, script_signal=restart.script_signal, grace_s=restart.grace_s)
        print(f"{PROG} [rank {self.rank}]: signal {self.signalled}: SIG{restart.script_signal} to the program, "
              f"{restart.grace_s} s to save and exit", flush=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(SIGNALS[restart.script_signal])
        self.kill_at = time.monotonic() + restart.grace_s

    def child_setup(self) -> Callable[[], None]:
        """The program dies with this process, and ignores restart.signal: Slurm sends that signal to every
        process of the step (scancel --signal, sbatch --signal), and the program's notice is script_signal,
        from here (unless the two are the same signal)."""
        from hpctrain.launch.rank_group import die_with_parent

        with_parent = die_with_parent()
        restart = self.job.restart
        ignored = SIGNALS[restart.signal] if restart.signal != restart.script_signal else None

        def setup() -> None:
            if with_parent is not None:
                with_parent()
            if ignored is not None:
                signal.signal(ignored, signal.SIG_IGN)  # an ignored signal stays ignored across exec
        return setup

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        for name in {self.job.restart.signal, "TERM"}:
            signal.signal(SIGNALS[name], self.on_signal)
        self.event(STARTED, program=argv[1:], world_size=int(env["WORLD_SIZE"]))
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=self.child_setup())
        forwarded = False
        while self.proc.poll() is None:
            if self.signalled is not None and not forwarded:
                forwarded = True
                self.forward()
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                print(f"{PROG} [rank {self.rank}]: the program did not exit within restart.grace_s="
                      f"{self.job.restart.grace_s}: killed", flush=True)
                self.proc.kill()
                self.kill_at = None
            time.sleep(POLL_S)
        return self.outcome(self.proc.returncode)

    def outcome(self, code: int) -> int:
        """What this rank exits with, and the marker or event that says why (the rule in the module doc)."""
        if code < 0:
            code = 128 - code  # killed by a signal, as a shell reports it
        if code == 2:
            bad_input(f"rank {self.rank}: the program exited 2 (bad input)")
            self.event(FAILED, reason="the program exited 2 (bad input)", exit_code=2)
            return 2
        if code != 0:
            self.event(FAILED, reason=f"the program exited with code {code}", exit_code=code)
            return code
        if self.signalled is None:
            self.event(FINISHED)
            return 0
        why = f"signal {self.signalled}; the program exited 0 after SIG{self.job.restart.script_signal} (saved)"
        if os.environ.get(REQUEUE_BY_ENV) == "batch-script":  # the exit path or the Ray driver requeues
            marker = os.environ.get(MARKER_ENV)
            if self.rank == 0 and marker:
                write_atomic(marker, why + "\n")
            self.event(REQUEUE_REQUESTED, reason=why)
            return 0
        # Nothing requeues this launcher's runs (the local executor): the run stopped without doing its work.
        from hpctrain.rundir.metrics import last_metrics

        step = (last_metrics(self.run_dir) or {}).get("step")
        self.event(STOPPED, reason=why, step=step)
        return 1 if self.rank == 0 else 0


def bad_input(line: str) -> None:
    marker = os.environ.get(BAD_INPUT_MARKER_ENV)
    if marker:
        try:
            append(marker, (line + "\n").encode("utf-8"))
        except OSError:
            pass  # exit 2 says it too


def rank_environment(job: Job, run_dir: Path, where: Mapping[str, int], rank: int, attempt: int,
                     checkpoint_dir: str, environ: Mapping[str, str]) -> dict[str, str]:
    p = job.parallel
    env = dict(environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(where["world_size"]), "LOCAL_RANK": str(where["local_rank"]),
                "LOCAL_WORLD_SIZE": str(where["local_world_size"]), "GROUP_RANK": str(where["group_rank"]),
                "MASTER_ADDR": environ.get("MASTER_ADDR", "127.0.0.1"),
                "MASTER_PORT": environ.get("MASTER_PORT", "29500"),
                "HPCTRAIN_RUN_DIR": str(run_dir), "HPCTRAIN_CHECKPOINT_DIR": checkpoint_dir,
                ATTEMPT_ENV: str(attempt), "HPCTRAIN_TP": str(p.tp), "HPCTRAIN_PP": str(p.pp),
                "HPCTRAIN_DP": str(p.dp), STOP_FILE_ENV: str(run_dir / STOP_FILE),
                SCRIPT_SIGNAL_ENV: job.restart.script_signal, "PYTHONUNBUFFERED": "1"})
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Run one rank of a job's entrypoint.")
    parser.add_argument("--job", required=True, help="job.resolved.yaml")
    parser.add_argument("--run-dir", required=True, help="the run directory")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).absolute()
    rank = 0
    try:
        from hpctrain.config import load_job

        if not os.path.isfile(args.job):
            raise ConfigError(f"--job {args.job}: no such file")
        job = load_job(args.job)
        where = place(os.environ, job.cluster.gpus_per_node)
        order = job.placement.rank_order if job.placement is not None else None
        rank = global_rank(where["slot"], order if order and len(order) == where["world_size"] else None)
        attempt = int(os.environ.get(ATTEMPT_ENV) or os.environ.get("SLURM_RESTART_COUNT") or 0)
        to_rank_log(rank, attempt)
        checkpoint_dir = job.checkpoint.dir or str(run_dir / CHECKPOINTS_DIR)
        os.makedirs(checkpoint_dir, exist_ok=True)
        values = {"tp": job.parallel.tp, "pp": job.parallel.pp, "dp": job.parallel.dp,
                  "world_size": where["world_size"], "run_dir": str(run_dir), "checkpoint_dir": checkpoint_dir}
        program = program_argv(job, values, sys.executable)
        env = rank_environment(job, run_dir, where, rank, attempt, checkpoint_dir, os.environ)
    except (ConfigError, OSError, ValueError) as exc:
        text = str(exc).splitlines() or [type(exc).__name__]
        for line in text:
            print(f"{PROG} [rank {rank}]: {line}", file=sys.stderr, flush=True)
        bad_input(f"rank {rank}: {text[0]}")
        return 2
    return Rank(job, run_dir, rank, attempt).run(program, env)


if __name__ == "__main__":
    sys.exit(main())
