"""Following a run to its end: `submit --wait`, `resume --wait`, `sweep --wait` and `hpctrain follow RUN`.

One loop (`wait_for_end`) polls `run_status` until the job, or every task of a sweep, has ended; on a
terminal it draws a progress bar (tqdm), elsewhere (a log file, CI, a batch job) it prints a line when the
state changes and every `progress_every_s` seconds with step, loss, tokens/s and an ETA. Its outcomes and
their exit codes (docs/architecture.md section 4): the final status (then `check_completed`: 0 when every
job completed, else JobFailedError, 1), WaitTimedOut (4) after the timeout, FollowInterrupted (130) on
Ctrl-C; in the last two the job goes on and the message says how to follow it again or cancel it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from hpctrain.config.types import slurm_time_seconds
from hpctrain.errors import HpctrainError, JobFailedError, WaitTimedOut
from hpctrain.launch.rundir import is_sweep
from hpctrain.launch.status import is_finished, run_status
from hpctrain.rundir.layout import RESOLVED_FILE
from hpctrain.rundir.read import read_yaml_mapping
from hpctrain.rundir.sweep_file import read_sweep

PROGRESS_EVERY_S = 30.0  # off a terminal: a progress line at least this often (--progress-every)
MAX_POLL_S = 10.0
DAY_S = 24 * 3600.0


def default_timeout_s(time_limit_s: Optional[float], max_requeues: int) -> float:
    """How long a wait lasts by default: the job's time limit for each of its attempts, plus 10 min; 24 h
    for a job without a time limit."""
    if time_limit_s is None:
        return DAY_S
    return time_limit_s * (1 + max_requeues) + 600.0


def sweep_waves(sweep: Mapping[str, Any]) -> int:
    """How many times over a sweep's tasks run one after another: tasks / max_parallel, rounded up."""
    return max(1, math.ceil(len(sweep.get("tasks", [])) / max(1, int(sweep.get("max_parallel") or 1))))


def run_timeout_s(run_dir: Path) -> float:
    """`follow`'s default timeout, from the run's resolved job (a sweep: times its waves of tasks)."""
    resolved = read_yaml_mapping(run_dir / RESOLVED_FILE) or {}
    slurm, restart = resolved.get("slurm") or {}, resolved.get("restart") or {}
    try:
        limit = slurm_time_seconds(str(slurm["time"])) if slurm.get("time") is not None else None
        one = default_timeout_s(limit, int(restart.get("max_requeues") or 0))
    except (ValueError, TypeError, AttributeError):  # not what a resolved job holds: the longest default
        return DAY_S
    return one * (sweep_waves(read_sweep(run_dir)) if is_sweep(run_dir) else 1)


def _clock_text(seconds: float) -> str:
    """`0:04:05`, `1 d 2:03:04`."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days} d {text}" if days else text


class _Eta:
    """Time left, from the steps this follower saw pass (the wall clock, evaluations and checkpoints
    included); before two steps were seen, from the last step's step_time_s."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.first: Optional[tuple[float, int]] = None

    def seconds(self, step: Optional[int], steps: Optional[int], step_time_s: Any) -> Optional[float]:
        if step is None or steps is None:
            return None
        now = self.clock()
        if self.first is None or step < self.first[1]:  # the first look, or a restart went back to a checkpoint
            self.first = (now, step)
        left = max(0, steps - step)
        done = step - self.first[1]
        if done > 0:
            return left * (now - self.first[0]) / done
        if isinstance(step_time_s, (int, float)) and step_time_s > 0:
            return left * float(step_time_s)
        return None


def progress_line(status: dict[str, Any], eta_s: Optional[float]) -> str:
    """`step 40/60 running loss 3.1234 12,345 tok/s ETA 0:00:12` (what a line off a terminal says)."""
    step = status.get("step")
    parts = [f"step {step if step is not None else '-'}/{status.get('steps') or '?'}", status["state"].lower()]
    if isinstance(status.get("loss"), (int, float)):
        parts.append(f"loss {status['loss']:.4f}")
    if isinstance(status.get("val_loss"), (int, float)):
        parts.append(f"val_loss {status['val_loss']:.4f}")
    if isinstance(status.get("tokens_per_s"), (int, float)):
        parts.append(f"{status['tokens_per_s']:,.0f} tok/s")
    if status["state"] in ("RUNNING", "PENDING", "REQUEUED", "SUBMITTED", "CONFIGURING"):
        parts.append(f"ETA {_clock_text(eta_s)}" if eta_s is not None else "ETA ?")
    if status.get("restarts"):
        parts.append(f"restarts {status['restarts']}")
    return " ".join(parts)


def sweep_line(status: dict[str, Any]) -> str:
    """`sweep: 1 COMPLETED, 2 RUNNING, 1 PENDING of 4 tasks`."""
    counts: dict[str, int] = {}
    for task in status.get("tasks", []):
        counts[task["state"]] = counts.get(task["state"], 0) + 1
    text = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return f"sweep: {text or 'no tasks'} of {len(status.get('tasks', []))} tasks"


class _Lines:
    """Off a terminal (or without tqdm): a line when the state changes and every `every_s` seconds."""

    def __init__(self, stream: TextIO, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.eta = _Eta(clock)
        self._state: Optional[str] = None
        self._printed_at = float("-inf")

    def update(self, status: dict[str, Any]) -> None:
        if status["kind"] == "sweep":
            line, state = sweep_line(status), sweep_line(status)
        else:
            line = progress_line(status, self.eta.seconds(status.get("step"), status.get("steps"),
                                                           status.get("step_time_s")))
            state = status["state"]
        now = self.clock()
        if state != self._state or now - self._printed_at >= self.every_s:
            print(line, file=self.stream, flush=True)
            self._state, self._printed_at = state, now

    def close(self) -> None:
        pass


class _TqdmBar:
    """On a terminal: a bar of steps with the state, tokens/s and losses after it (tqdm shows the ETA)."""

    def __init__(self, total: Optional[int], stream: TextIO) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", file=stream, dynamic_ncols=True, leave=True)

    def update(self, status: dict[str, Any]) -> None:
        step = int(status.get("step") or 0)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        self.bar.set_postfix_str(_postfix(status), refresh=True)

    def close(self) -> None:
        self.bar.close()


def _postfix(status: dict[str, Any]) -> str:
    parts = [status["state"].lower()]
    if isinstance(status.get("tokens_per_s"), (int, float)):
        parts.append(f"{status['tokens_per_s']:.0f} tok/s")
    if isinstance(status.get("loss"), (int, float)):
        parts.append(f"loss {status['loss']:.4f}")
    if isinstance(status.get("val_loss"), (int, float)):
        parts.append(f"val_loss {status['val_loss']:.4f}")
    if status.get("restarts"):
        parts.append(f"restarts {status['restarts']}")
    return " ".join(parts)


def _display(status: dict[str, Any], stream: TextIO, every_s: float) -> Any:
    """tqdm for a job on a terminal; a line now and then elsewhere, and for a sweep."""
    if stream.isatty() and status["kind"] == "job":
        try:
            return _TqdmBar(status.get("steps"), stream)
        except ImportError:  # tqdm is optional on a login node
            pass
    return _Lines(stream, every_s)


def _again(run_dir: Path) -> str:
    return (f"  follow it again: hpctrain follow {run_dir}\n"
            f"  cancel it:       hpctrain cancel {run_dir}")


class FollowInterrupted(HpctrainError):
    """Ctrl-C while following: only the following stops, the job goes on (exit 130, as for SIGINT)."""

    exit_code = 130

    def __init__(self, run_dir: Path, job_id: Optional[str]) -> None:
        job = f"job {job_id}" if job_id else "the job"
        super().__init__(f"interrupted: stopped following; {job} goes on ({run_dir})\n" + _again(run_dir))


def wait_for_end(run_dir: Path, timeout_s: float, *, env: Optional[Mapping[str, str]] = None,
                 interval_s: float = 1.0, stream: TextIO = sys.stderr,
                 on_poll: Optional[Callable[[], object]] = None, job_id: Optional[str] = None,
                 progress_every_s: float = PROGRESS_EVERY_S) -> dict[str, Any]:
    """Poll until the job (every task of a sweep) has ended and return its status, showing progress.

    WaitTimedOut after `timeout_s`, FollowInterrupted on Ctrl-C: the job goes on in both.
    """
    try:
        return _poll(run_dir, timeout_s, env, interval_s, stream, on_poll, progress_every_s)
    except KeyboardInterrupt:
        raise FollowInterrupted(run_dir, job_id) from None


def check_completed(run_dir: Path, status: dict[str, Any]) -> None:
    """JobFailedError (exit 1) unless the job, or every task of the sweep, COMPLETED."""
    states = [t["state"] for t in status.get("tasks", [])] or [status["state"]]
    if any(s != "COMPLETED" for s in states):
        reason = status.get("reason") or ", ".join(f"task {t['task_id']} {t['state']}" for t in status.get("tasks", [])
                                                   if t["state"] != "COMPLETED")
        raise JobFailedError(f"{run_dir.name}: {status['state']}" + (f" ({reason})" if reason else "")
                             + f"; see `hpctrain logs {run_dir}`")


def follow(run_dir: Path, timeout_s: float, **options: Any) -> dict[str, Any]:
    """wait_for_end, then check_completed: the status of a job that completed, else an exception."""
    status = wait_for_end(run_dir, timeout_s, **options)
    check_completed(run_dir, status)
    return status


def summary(status: dict[str, Any]) -> list[str]:
    """What a finished wait prints: `COMPLETED at step 60`, or for a sweep one line per task."""
    if status["kind"] == "job":
        return [f"{status['state']} at step {status.get('step')}"]
    lines = []
    for task in status.get("tasks", []):
        point = " ".join(f"{k}={v}" for k, v in (task.get("point") or {}).items())
        step = f"{task['step'] if task.get('step') is not None else '-'}/{task.get('steps') or '?'}"
        reason = f" ({task['reason']})" if task.get("reason") and task["state"] != "COMPLETED" else ""
        lines.append(f"task {task['task_id']} {point}: {task['state']}{reason} at step {step}")
    done = sum(task["state"] == "COMPLETED" for task in status.get("tasks", []))
    lines.append(f"{done} of {len(status.get('tasks', []))} tasks completed")
    return lines


def _progress_of(status: dict[str, Any]) -> tuple[Any, ...]:
    """What a change of means that the job moved on: its state and step, or each task's."""
    return tuple((row.get("state"), row.get("step")) for row in [status, *status.get("tasks", [])])


def _poll(run_dir: Path, timeout_s: float, env: Optional[Mapping[str, str]], interval_s: float, stream: TextIO,
          on_poll: Optional[Callable[[], object]], progress_every_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    wait_s = interval_s
    status = run_status(run_dir, env)
    display = _display(status, stream, progress_every_s)
    try:
        while True:
            if on_poll:
                on_poll()
            display.update(status)
            if is_finished(status):
                break
            if time.monotonic() > deadline:
                raise WaitTimedOut(f"timed out after {timeout_s:g} s waiting for {run_dir.name} (state "
                                   f"{status['state']}); the job goes on\n" + _again(run_dir))
            # Each poll may ask the scheduler (scontrol/sacct): back off to at most MAX_POLL_S while nothing
            # changes, and look again soon after something did; never sleep past the deadline or the next line.
            time.sleep(max(0.05, min(wait_s, deadline - time.monotonic() + 0.05, progress_every_s)))
            previous = _progress_of(status)
            status = run_status(run_dir, env)
            changed = _progress_of(status) != previous
            wait_s = interval_s if changed else min(wait_s * 1.5, max(interval_s, MAX_POLL_S))
    finally:
        display.close()
    return status
