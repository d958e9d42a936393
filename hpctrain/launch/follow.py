"""`submit --wait`: follow a job to its end with a progress bar of steps and tokens/s, within a timeout."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Optional, TextIO

from hpctrain.errors import HpctrainError, JobFailedError
from hpctrain.launch.status import is_finished, run_status


class _PlainBar:
    """What is printed when tqdm is not installed (or output is not a terminal): a line per change."""

    def __init__(self, total: Optional[int], stream: TextIO) -> None:
        self.total, self.n, self.stream, self._last = total, 0, stream, ""

    def update_to(self, step: int, postfix: str) -> None:
        self.n = step
        line = f"step {step}/{self.total or '?'} {postfix}".rstrip()
        if line != self._last:
            print(line, file=self.stream, flush=True)
            self._last = line

    def close(self) -> None:
        pass


class _TqdmBar:
    def __init__(self, total: Optional[int], stream: TextIO) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", file=stream, dynamic_ncols=True, leave=True)

    def update_to(self, step: int, postfix: str) -> None:
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        self.bar.set_postfix_str(postfix, refresh=True)

    def close(self) -> None:
        self.bar.close()


def _bar(total: Optional[int], stream: TextIO) -> Any:
    """tqdm on a terminal; elsewhere (a log file, CI) a plain line whenever the step or state changes."""
    if stream.isatty():
        try:
            return _TqdmBar(total, stream)
        except ImportError:  # tqdm is optional on a login node
            pass
    return _PlainBar(total, stream)


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


MAX_POLL_S = 10.0


class FollowInterrupted(HpctrainError):
    """Ctrl-C while following: only the following stops, the job goes on (exit 130, as for SIGINT)."""

    exit_code = 130

    def __init__(self, run_dir: Path, job_id: Optional[str]) -> None:
        job = f"job {job_id}" if job_id else "the job"
        super().__init__(f"interrupted: stopped following; {job} goes on ({run_dir})\n"
                         f"  follow it again: hpctrain status {run_dir}\n"
                         f"  cancel it:       hpctrain cancel {run_dir}")


def follow(run_dir: Path, timeout_s: float, *, env: Optional[Mapping[str, str]] = None,
           interval_s: float = 1.0, stream: TextIO = sys.stderr,
           on_poll: Optional[Callable[[], object]] = None, job_id: Optional[str] = None) -> dict[str, Any]:
    """Poll until the job (every task of a sweep) has ended; raise JobFailedError unless all COMPLETED.

    Ctrl-C raises FollowInterrupted, which says that the job goes on and how to cancel it.
    """
    try:
        status = _follow(run_dir, timeout_s, env, interval_s, stream, on_poll)
    except KeyboardInterrupt:
        raise FollowInterrupted(run_dir, job_id) from None
    states = [t["state"] for t in status.get("tasks", [])] or [status["state"]]
    if any(s != "COMPLETED" for s in states):
        reason = status.get("reason") or ", ".join(f"task {t['task_id']} {t['state']}" for t in status.get("tasks", [])
                                                   if t["state"] != "COMPLETED")
        raise JobFailedError(f"{run_dir.name}: {status['state']}" + (f" ({reason})" if reason else "")
                             + f"; see `hpctrain logs {run_dir}`")
    return status


def _follow(run_dir: Path, timeout_s: float, env: Optional[Mapping[str, str]], interval_s: float, stream: TextIO,
            on_poll: Optional[Callable[[], object]]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    wait_s = interval_s
    status = run_status(run_dir, env)
    bar = _bar(status.get("steps"), stream) if status["kind"] == "job" else None
    try:
        while True:
            if on_poll:
                on_poll()
            if bar is not None:
                bar.update_to(int(status.get("step") or 0), _postfix(status))
            if is_finished(status):
                break
            if time.monotonic() > deadline:
                raise HpctrainError(f"timed out after {timeout_s:g} s waiting for {run_dir.name} (state "
                                    f"{status['state']}); it keeps running: follow it with `hpctrain status "
                                    f"{run_dir}` or stop it with `hpctrain cancel {run_dir}`")
            # Each poll may ask the scheduler (scontrol/sacct): back off to at most MAX_POLL_S while nothing
            # changes, and look again soon after something did.
            time.sleep(wait_s)
            previous = (status.get("state"), status.get("step"))
            status = run_status(run_dir, env)
            changed = (status.get("state"), status.get("step")) != previous
            wait_s = interval_s if changed else min(wait_s * 1.5, max(interval_s, MAX_POLL_S))
    finally:
        if bar is not None:
            bar.close()
    return status
