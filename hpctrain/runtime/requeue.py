"""Stop cleanly and come back: signals, the ranks' collective stop decision, time-limit safety, requeue.

The protocol with the rendered batch script (sbatch_templates/requeue_protocol.sh.j2):

1. `restart.signal` (default USR2, sent to every rank `signal_seconds` before the limit and at
   preemption) and SIGTERM only set a flag (`SignalFlag`); nothing else runs in the handler.
2. At every step boundary all ranks agree with one all-reduce(MAX) over (signal number, "time is
   short"): one rank's signal stops every rank at the same step (`RequeueController.should_stop`).
3. The trainer saves a checkpoint collectively, then `finish` asks for the requeue:
   - `HPCTRAIN_REQUEUE_BY=batch-script` (the rendered script): rank 0 writes one line, the reason,
     to `HPCTRAIN_REQUEUE_MARKER`; the script requeues the exact job from the host after srun, within
     `restart.max_requeues`. The runtime never calls scontrol here (it may be missing in a container).
   - unset (the runtime launched some other way): rank 0 runs `scontrol requeue` on the exact job
     (`ARRAYJOBID_TASKID` for an array task) within the budget, and says so loudly when it cannot.
   All ranks then exit 0 (docs/architecture.md section 4). When nothing will requeue the job (not under Slurm, the
   budget spent, scontrol missing or failing, no checkpoint), rank 0 exits 1: the run stopped without
   doing its work, so the launcher records it STOPPED (local) or failed, never COMPLETED; a launcher
   that asked for the stop itself (a local cancel) records CANCELLED.

Time-limit safety: rank 0 learns the job's end time once at start (SLURM_JOB_END_TIME, else
`squeue -o %e`, else the start time plus slurm.time) and refreshes it from squeue every few
minutes (limits are changed with `scontrol update`). When the time left is below
max(2 x the last save's duration + one step, a margin) the job stops and requeues even if the signal
is late: Slurm checks limits on a ~30 s tick, so the signal can come that much late or early.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.config.infra import RestartConfig
from hpctrain.rundir.events import NOT_REQUEUED, REQUEUE_REQUESTED, REQUEUED, SIGNAL, TIME_LIMIT_NEAR
from hpctrain.rundir.restart import Markers, decide
from hpctrain.rundir.safe_files import write_atomic

if TYPE_CHECKING:
    from hpctrain.config import Job

REQUEUE_BY_ENV = "HPCTRAIN_REQUEUE_BY"  # "batch-script": the script requeues, not the runtime
MARKER_ENV = "HPCTRAIN_REQUEUE_MARKER"  # the file rank 0 writes the reason to
TIME_MARGIN_ENV = "HPCTRAIN_TIME_MARGIN_S"  # override of DEFAULT_TIME_MARGIN_S
# Tests only: seconds each rank sleeps at every step boundary, so that faults land mid-run.
STEP_DELAY_ENV = "HPCTRAIN_TEST_STEP_DELAY_S"
DEFAULT_TIME_MARGIN_S = 60.0  # two of Slurm's ~30 s limit-checking ticks
END_TIME_REFRESH_S = 300.0  # how often rank 0 asks squeue again
SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "TERM": signal.SIGTERM, "INT": signal.SIGINT,
           "HUP": signal.SIGHUP}
TIME_SHORT = 1  # second element of the agreed vector


class SignalFlag:
    """What the handlers saw: the last signal number and when (set in the handler, read at step boundaries)."""

    def __init__(self) -> None:
        self.signum = 0
        self.received_s: Optional[float] = None
        self.previous: dict[int, Any] = {}

    def handler(self, signum: int, frame: Any) -> None:
        self.signum = signum  # only a flag: no I/O, no collectives, no exceptions in a signal handler
        self.received_s = time.time()

    def install(self, signal_name: str) -> None:
        """Catch restart.signal and SIGTERM (main thread only, as Python requires)."""
        for signum in {SIGNALS[signal_name], signal.SIGTERM}:
            if signum not in self.previous:
                self.previous[signum] = signal.signal(signum, self.handler)


FLAG = SignalFlag()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name.removeprefix("SIG")
    except ValueError:
        return str(signum)


# -- what Slurm says about this job (pure functions of the environment and of command output) -------
def requeue_target(environ: Mapping[str, str]) -> Optional[str]:
    """The id `scontrol requeue` must get: ARRAYJOBID_TASKID for an array task (never the whole array)."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def parse_end_time(text: str) -> Optional[float]:
    """Epoch seconds from squeue's %e (local time, e.g. 2024-05-01T12:00:00); None for N/A, Unknown, ..."""
    text = text.strip().splitlines()[0].strip() if text.strip() else ""
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment.timestamp()  # naive: local time, as squeue prints it


def end_time_from_env(environ: Mapping[str, str], time_limit: Optional[str],
                      now_s: float) -> tuple[Optional[float], str]:
    """(end time, source) from the environment alone: SLURM_JOB_END_TIME, else start (or now) + slurm.time."""
    if environ.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(environ["SLURM_JOB_END_TIME"]), "SLURM_JOB_END_TIME"
    if time_limit:
        from hpctrain.config.types import slurm_time_seconds

        try:
            limit_s = slurm_time_seconds(str(time_limit))
        except ValueError:
            return None, "none"
        start = environ.get("SLURM_JOB_START_TIME", "")
        if start.isdigit():
            return float(start) + limit_s, "SLURM_JOB_START_TIME + slurm.time"
        return now_s + limit_s, "process start + slurm.time"
    return None, "none"


def squeue_end_time(job_id: str, run: Callable[..., Any] = subprocess.run) -> Optional[float]:
    """The job's end time from `squeue -h -j ID -o %e`; None when squeue is missing or does not know."""
    try:
        out = run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=10,
                  check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_end_time(out.stdout) if out.returncode == 0 else None


def default_margin_s(time_limit: Optional[str]) -> float:
    """DEFAULT_TIME_MARGIN_S, but at most a tenth of a short job's limit (a 5-minute job keeps 30 s)."""
    if not time_limit:
        return DEFAULT_TIME_MARGIN_S
    from hpctrain.config.types import slurm_time_seconds

    try:
        return min(DEFAULT_TIME_MARGIN_S, 0.1 * slurm_time_seconds(str(time_limit)))
    except ValueError:
        return DEFAULT_TIME_MARGIN_S


def time_needed_s(save_s: Optional[float], step_s: Optional[float], margin_s: float) -> float:
    """Time to keep in hand before the limit: max(2 x save + one step, margin)."""
    return max(2.0 * (save_s or 0.0) + (step_s or 0.0), margin_s)


@dataclass
class Decision:
    """What the ranks agreed on at a step boundary."""

    stop: bool
    reason: str = ""
    signum: int = 0


class RequeueController:
    """One per rank: the stop decision at step boundaries, and the requeue once the checkpoint is saved."""

    def __init__(self, job: Job, env: Any, device: Any, event: Callable[..., None],
                 flag: SignalFlag = FLAG, environ: Optional[Mapping[str, str]] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.env, self.device, self.event, self.flag, self.clock = env, device, event, flag, clock
        self.environ = os.environ if environ is None else environ
        self.policy: RestartConfig = job.restart
        self.signal_name, self.max_requeues, self.requeue_enabled = (job.restart.signal, job.restart.max_requeues,
                                                                      job.restart.requeue)
        self.time_limit = job.slurm.time
        self.margin_s = float(self.environ.get(TIME_MARGIN_ENV) or default_margin_s(self.time_limit))
        self.step_delay_s = float(self.environ.get(STEP_DELAY_ENV, "0") or 0)
        self.job_id = self.environ.get("SLURM_JOB_ID")
        self.target = requeue_target(self.environ)
        self.decision = Decision(False)
        self.why_not: Optional[str] = None  # why a stop did not lead to a requeue (finish())
        self.save_s: Optional[float] = None  # the last save's duration
        self._last_boundary_s: Optional[float] = None
        self._why = ""  # rank 0: why time is short, from the last local_flags
        self.end_time_s: Optional[float] = None
        self.end_source = "none"
        self._refreshed_s = clock()
        if env.rank == 0 and self.job_id:
            self._learn_end_time()

    # -- time-limit safety (rank 0) ----------------------------------------------------------------
    def _learn_end_time(self) -> None:
        end, source = end_time_from_env(self.environ, self.time_limit, self.clock())
        if source != "SLURM_JOB_END_TIME" and self.job_id:
            from_squeue = squeue_end_time(self.job_id)
            if from_squeue is not None:
                end, source = from_squeue, "squeue"
        self.end_time_s, self.end_source = end, source

    def _time_short(self, step_s: Optional[float]) -> tuple[bool, str]:
        if self.end_time_s is None:
            return False, ""
        now = self.clock()
        if self.end_source == "squeue" and now - self._refreshed_s > END_TIME_REFRESH_S:
            self._refreshed_s = now
            refreshed = squeue_end_time(self.job_id or "")
            self.end_time_s = refreshed if refreshed is not None else self.end_time_s
        left_s = self.end_time_s - now
        needed_s = time_needed_s(self.save_s, step_s, self.margin_s)
        if left_s >= needed_s:
            return False, ""
        return True, (f"time limit: {left_s:.0f} s left (end time from {self.end_source}) < {needed_s:.0f} s "
                      f"needed (2 x save {self.save_s or 0:.1f} s + step {step_s or 0:.1f} s, margin "
                      f"{self.margin_s:.0f} s)")

    # -- the step boundary (every rank) ---------------------------------------------------------------
    def should_stop(self, step: int, save_s: Optional[float] = None) -> bool:
        """Called by every rank after each step: True on all ranks together when one got a signal or time is short.

        `save_s`: how long the last checkpoint save took (None before the first one). One
        collective of its own; the trainer folds the same flags into its per-step reduction
        instead (`local_flags` then `decide`), so that a step blocks the host once.
        """
        if self.decision.stop:
            return True
        return self.decide(step, *self._agree(*self.local_flags(save_s)))

    def local_flags(self, save_s: Optional[float] = None) -> tuple[int, int]:
        """This rank's (signal number or 0, TIME_SHORT or 0) at a step boundary; no communication.
        The flags of all ranks are combined by maximum before `decide`."""
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        self.save_s = save_s if save_s is not None else self.save_s
        now = time.perf_counter()
        step_s = now - self._last_boundary_s if self._last_boundary_s is not None else None
        self._last_boundary_s = now
        short, self._why = self._time_short(step_s) if self.env.rank == 0 else (False, "")
        return self.flag.signum, TIME_SHORT if short else 0

    def decide(self, step: int, signum: int, time_short: int) -> bool:
        """The stop decision from the flags agreed by every rank (their maximum)."""
        if self.decision.stop:
            return True
        if not signum and not time_short:
            return False
        if signum:
            name = signal_name(signum)
            reason = f"signal {name} at step {step}"
            delay = round(self.clock() - self.flag.received_s, 3) if self.flag.received_s else None
            self.event(SIGNAL, signal=name, step=step, handled_after_s=delay)
        else:
            reason = self._why or f"time limit near at step {step}"
            self.event(TIME_LIMIT_NEAR, step=step, reason=reason,
                       end_time=self.end_time_s, end_time_source=self.end_source)
        if self.env.rank == 0:
            print(f"hpctrain.runtime: stopping after step {step} to save and requeue: {reason}", flush=True)
        self.decision = Decision(True, reason, signum)
        return True

    def _agree(self, signum: int, time_short: int) -> tuple[int, int]:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return signum, time_short
        flags = torch.tensor([signum, time_short], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()
        return int(values[0]), int(values[1])

    # -- after the final checkpoint (every rank calls it; rank 0 acts) ----------------------------------
    def finish(self, step: int, saved: bool) -> Optional[str]:
        """Ask for the requeue once the checkpoint of `step` is complete; return what was done (rank 0)."""
        if not self.decision.stop or self.env.rank != 0:
            return None
        reason = self.decision.reason
        if not saved:
            print(f"hpctrain.runtime: NOT requeueing: no complete checkpoint at step {step} ({reason})",
                  file=sys.stderr, flush=True)
            self.why_not = "no-checkpoint"
            self.event(NOT_REQUEUED, reason=reason, why_not="no-checkpoint", step=step)
            return "not-requeued"
        if self.environ.get(REQUEUE_BY_ENV) == "batch-script":
            return self._ask_batch_script(step, reason)
        return self._requeue_directly(step, reason)

    def _ask_batch_script(self, step: int, reason: str) -> str:
        marker = self.environ.get(MARKER_ENV)
        if not marker:
            print(f"hpctrain.runtime: NOT requeued: {REQUEUE_BY_ENV}=batch-script but {MARKER_ENV} is unset; "
                  f"the batch script cannot see the request ({reason})", file=sys.stderr, flush=True)
            self.why_not = "no-marker-path"
            self.event(NOT_REQUEUED, reason=reason, why_not="no-marker-path", step=step)
            return "not-requeued"
        write_marker(marker, reason)
        self.event(REQUEUE_REQUESTED, reason=reason, step=step, by="batch-script", marker=marker)
        print(f"hpctrain.runtime: checkpoint at step {step} saved; the batch script requeues job "
              f"{self.target or '?'} ({reason})", flush=True)
        return "marker"

    def _requeue_directly(self, step: int, reason: str) -> str:
        if not self.target:
            print(f"hpctrain.runtime: stopped after saving step {step} ({reason}); not under Slurm, so nothing "
                  "requeues it: continue with `hpctrain resume RUN`", file=sys.stderr, flush=True)
            self.why_not = "not-under-slurm"
            self.event(NOT_REQUEUED, reason=reason, why_not="not-under-slurm", step=step)
            return "not-requeued"
        # The runtime asks after a saved stop: the policy's runtime-requested case (rundir/restart.py).
        verdict = decide(0, Markers(requeue_requested=reason), step, None, self.env.attempt, self.policy)
        if not verdict.requeue:
            why_not = verdict.reason
            print(f"hpctrain.runtime: NOT requeued ({why_not}: attempt {self.env.attempt}, restart.max_requeues="
                  f"{self.max_requeues}, restart.requeue={self.requeue_enabled}); {reason}", file=sys.stderr,
                  flush=True)
            self.why_not = why_not
            self.event(NOT_REQUEUED, reason=reason, why_not=why_not, step=step)
            return "not-requeued"
        try:
            out = subprocess.run(["scontrol", "requeue", self.target], capture_output=True, text=True, timeout=60,
                                 check=False)
        except FileNotFoundError:
            print(f"hpctrain.runtime: NOT requeued: `scontrol` is not on PATH here (inside a container?); "
                  f"run `scontrol requeue {self.target}` on the host, or launch with the rendered batch script, "
                  f"which requeues from outside the container ({reason})", file=sys.stderr, flush=True)
            self.why_not = "scontrol-missing"
            self.event(NOT_REQUEUED, reason=reason, why_not="scontrol-missing", step=step, job_id=self.target)
            return "not-requeued"
        except subprocess.TimeoutExpired:
            out = subprocess.CompletedProcess([], 124, "", "timed out after 60 s")
        if out.returncode != 0:
            message = (out.stderr or out.stdout).strip().splitlines()
            print(f"hpctrain.runtime: NOT requeued: scontrol requeue {self.target} exited {out.returncode}: "
                  f"{message[-1] if message else ''} ({reason})", file=sys.stderr, flush=True)
            self.why_not = "scontrol-failed"
            self.event(NOT_REQUEUED, reason=reason, why_not="scontrol-failed", step=step, job_id=self.target)
            return "not-requeued"
        print(f"hpctrain.runtime: requeued job {self.target} after saving step {step} ({reason})", flush=True)
        self.event(REQUEUED, reason=reason, step=step, job_id=self.target, by="runtime")
        return "requeued"


def write_marker(path: str, reason: str) -> None:
    """One line, the reason, written whole (the batch script reads it after srun)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    write_atomic(path, " ".join(reason.split()) + "\n", fsync=True)
