"""`status`: where a run (or each task of a sweep) stands — scheduler state, restarts, step, tokens/s.

The scheduler's view (`Executor.state` of the executor that submitted the run: scontrol then sacct,
the local supervisor's state file, the Ray Jobs API, kubectl) is joined with what the runtime left in
the run directory: the last metrics line and the lifecycle events.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from hpctrain.launch import rundir
from hpctrain.launch.executor import ACTIVE_STATES, UNKNOWN, SchedulerState, active_states_of, executor_of
from hpctrain.rundir.events import (
    CANCEL_REQUESTED, DRY_RUN, ENDED, FAILED, FINISHED, LAYOUT_CHANGED, NOT_REQUEUED, REQUEUE_REQUESTED, REQUEUED,
    RESUME_REQUESTED, RESUMED, SIGNAL, STARTED, STOPPED, SUBMITTED, TIME_LIMIT_NEAR, WHY_NOT_REQUEUED,
)
from hpctrain.rundir.layout import RESOLVED_FILE
from hpctrain.rundir.metrics import last_metrics, last_value
from hpctrain.rundir.read import read_yaml_mapping
from hpctrain.rundir.sweep_file import read_sweep
from hpctrain.rundir.terminal import printable

ACTIVE = ACTIVE_STATES  # in Slurm's words; an executor may have its own (Executor.active_states)
# Events shown as the restart history (written by the launcher and the runtime).
HISTORY_EVENTS = (SUBMITTED, STARTED, RESUMED, SIGNAL, TIME_LIMIT_NEAR, REQUEUE_REQUESTED, REQUEUED, NOT_REQUEUED,
                  STOPPED, FINISHED, FAILED, ENDED, CANCEL_REQUESTED, RESUME_REQUESTED, LAYOUT_CHANGED)


def total_steps(run_dir: Path) -> Optional[int]:
    return _steps_of(read_yaml_mapping(run_dir / RESOLVED_FILE))


def _steps_of(resolved: Optional[dict[str, Any]]) -> Optional[int]:
    train = resolved.get("train") if resolved else None
    if isinstance(resolved, dict) and resolved.get("entrypoint"):
        return None  # the job's own program decides how many steps it runs (train.steps is not its setting)
    steps = train.get("steps", 100) if isinstance(train, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def layouts(run_dir: Path, events: list[dict[str, Any]],
            resolved: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """Every layout the run has had, oldest first: the submitted one, then each layout_changed's new one
    (elastic jobs re-plan at each start; hpctrain.launch.replan). The current one is last.
    `resolved`: job.resolved.yaml when the caller has read it already."""
    from hpctrain.rundir.layouts import layout_of

    changes = [e for e in events if e.get("event") == LAYOUT_CHANGED]
    if not changes:
        if resolved is None:
            resolved = read_yaml_mapping(run_dir / RESOLVED_FILE)
        current = layout_of(resolved or {})
        return [current] if current.get("nodes") is not None else []
    from hpctrain.rundir.layouts import mapping

    out = [mapping(changes[0].get("old"))]
    for change in changes:
        out.append({**mapping(change.get("new")), "attempt": change.get("attempt")})
    return out


def _since_last_submission(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    starts = [i for i, e in enumerate(events) if e.get("event") == SUBMITTED]
    return events[starts[-1]:] if starts else events


def restarts_from_events(events: list[dict[str, Any]]) -> int:
    """Restarts of the current submission seen by the runtime: starts beyond the first, or the attempt number."""
    started = [e for e in _since_last_submission(events) if e.get("event") == STARTED]
    attempts = [int(e["attempt"]) for e in started if isinstance(e.get("attempt"), int)]
    return max([len(started) - 1, *attempts, 0])


def task_status(run_dir: Path, job_id: Optional[str], executor: Optional[str],
                scheduler: Optional[SchedulerState] = None, *, details: bool = True) -> dict[str, Any]:
    """One job or task: state, restarts, step, tokens/s, history. `scheduler`: its executor's answer (asked
    first: the events, read after it, hold whatever a job that has just ended wrote). Without `details`, only
    what the list of runs shows (state, reason, restarts, step, steps): no history, layouts or losses."""
    events = rundir.read_events(run_dir)
    out: dict[str, Any] = {"run_dir": str(run_dir), "job_id": job_id, "executor": executor}
    if job_id is None:
        failed = [e for e in events if e.get("event") == FAILED and e.get("stage") == "submit"]
        state = "SUBMIT_FAILED" if failed else ("DRY_RUN" if any(e.get("event") == DRY_RUN for e in events)
                                               else "NOT_SUBMITTED")
        reason = failed[-1].get("reason") if failed else None
        scheduler_restarts = 0
    else:
        scheduler = scheduler or UNKNOWN
        state, reason, scheduler_restarts = scheduler.state, scheduler.reason, scheduler.restarts
    metrics = last_metrics(run_dir) or {}
    if state not in ACTIVE:
        reason = _not_requeued(events) or reason
    resolved = read_yaml_mapping(run_dir / RESOLVED_FILE)  # read once: the steps and the layout
    out.update(state=state, reason=reason,
               restarts=max(scheduler_restarts, restarts_from_events(events)),
               step=metrics.get("step"), steps=_steps_of(resolved))
    if details:
        out.update(tokens_per_s=metrics.get("tokens_per_s"), step_time_s=metrics.get("step_time_s"),
                   loss=metrics.get("loss"), val_loss=_val_loss(run_dir),
                   layouts=layouts(run_dir, events, resolved),
                   history=[e for e in events if e.get("event") in HISTORY_EVENTS])
    return out


def _not_requeued(events: list[dict[str, Any]]) -> Optional[str]:
    """Why the batch script did not requeue the current submission (its not_requeued event), or None."""
    refused = [e for e in _since_last_submission(events)
               if e.get("event") == NOT_REQUEUED and e.get("why_not") in WHY_NOT_REQUEUED]
    return f"not requeued: {WHY_NOT_REQUEUED[refused[-1]['why_not']]}" if refused else None


def _val_loss(run_dir: Path) -> Optional[float]:
    """The newest validation loss (train.eval_every): logged on evaluation steps only."""
    found = last_value(run_dir, "val_loss")
    return found[1] if found else None


def aggregate(states: list[str]) -> str:
    if not states:
        return "UNKNOWN"
    if len(set(states)) == 1:
        return states[0]
    for state in ("RUNNING", "PENDING", "REQUEUED", "CONFIGURING", "COMPLETING"):
        if state in states:
            return state
    return "FAILED" if "FAILED" in states else "MIXED"


def run_status(run_dir: Path, env: Optional[Mapping[str, str]] = None, *, details: bool = True) -> dict[str, Any]:
    """The status of a run directory: a job, or a sweep with one entry per task. Without `details`, each job
    or task has only what the list of runs shows (task_status)."""
    sub = rundir.last_submission(run_dir)
    job_id, executor = (sub.get("job_id"), sub.get("executor")) if sub else (None, None)
    name = run_dir.name
    sweep = read_sweep(run_dir) if rundir.is_sweep(run_dir) else None
    # (task id, job id of the task, its run directory): one row for a job, one per task of a sweep
    rows = [(None, str(job_id) if job_id else None, run_dir)] if sweep is None else [
        (entry["task_id"], f"{job_id}_{entry['task_id']}" if job_id else None, run_dir / entry["run_dir"])
        for entry in sweep.get("tasks", [])]
    states = scheduler_states(sub, [(jid, path) for _, jid, path in rows if jid], env) if job_id and sub else {}
    if sweep is None:
        return {"kind": "job", "name": name, **task_status(run_dir, rows[0][1], executor, states.get(rows[0][1] or ""),
                                                           details=details)}
    tasks = []
    for (task_id, task_job, task_dir), entry in zip(rows, sweep.get("tasks", [])):
        status = task_status(task_dir, task_job, executor, states.get(task_job or ""), details=details)
        tasks.append({"task_id": task_id, "point": entry.get("point"), **status})
    state = aggregate([t["state"] for t in tasks])
    return {"kind": "sweep", "name": name, "run_dir": str(run_dir), "job_id": job_id, "executor": executor,
            "array": sweep.get("array"), "state": state, "tasks": tasks, "skipped": sweep.get("skipped", [])}


def scheduler_states(submitted: Mapping[str, Any], jobs: Sequence[tuple[str, Path]],
                     env: Optional[Mapping[str, str]] = None) -> dict[str, SchedulerState]:
    """The submitting executor's view of `jobs` (job id, run directory), in one call for an array."""
    return executor_of(submitted, env).state(submitted, jobs)


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as None: JSON has no NaN (a diverged loss is `nan` in metrics.jsonl)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def is_active(row: dict[str, Any]) -> bool:
    """A job or task (a row of run_status) that is still queued or running, in its executor's vocabulary."""
    return row["state"] in active_states_of(row.get("executor"))


def is_finished(status: dict[str, Any]) -> bool:
    rows = status.get("tasks") or [status]
    return all(not is_active(row) and row["state"] != "UNKNOWN" for row in rows)


def format_table(status: dict[str, Any]) -> str:
    """A table for humans: one row per job or task, then the restart history."""
    from tabulate import tabulate

    rows = status["tasks"] if status["kind"] == "sweep" else [status]
    header = ["task", "job id", "state", "restarts", "step", "tokens/s (last)", "loss"]
    with_val = any(isinstance(row.get("val_loss"), (int, float)) for row in rows)
    if with_val:
        header.append("val loss")
    table = []
    for row in rows:
        total = row.get("steps") or "?"
        step = f"{row['step']}/{total}" if row.get("step") is not None else f"-/{total}"
        tps = f"{row['tokens_per_s']:.0f}" if isinstance(row.get("tokens_per_s"), (int, float)) else "-"
        loss = f"{row['loss']:.4f}" if isinstance(row.get("loss"), (int, float)) else "-"
        state = row["state"] + (f" ({row['reason']})" if row.get("reason") and not is_active(row) else "")
        table.append([row.get("task_id", "-"), row.get("job_id") or "-", state, row.get("restarts", 0), step, tps, loss])
        if with_val:
            table[-1].append(f"{row['val_loss']:.4f}" if isinstance(row.get("val_loss"), (int, float)) else "-")
    lines = [f"{status['name']}  ({status['run_dir']}, executor {status.get('executor') or '-'})",
             tabulate(table, headers=header, tablefmt="simple")]
    for skipped in status.get("skipped", []):
        point = " ".join(f"{k}={v}" for k, v in skipped["point"].items())
        lines.append(f"skipped {point}: " + " ".join(line.strip() for line in skipped["reason"].splitlines()))
    if status["kind"] == "job" and len(status.get("layouts") or []) > 1:
        from hpctrain.rundir.layouts import describe

        lines.append("layouts:")
        for layout in status["layouts"]:
            since = f"attempt {layout['attempt']}" if layout.get("attempt") is not None else "submitted"
            lines.append(f"  {since}: {describe(layout)}")
    if status["kind"] == "job" and status.get("restarts"):
        lines.append("history:")
        for event in status.get("history", []):
            extra = {k: v for k, v in event.items() if k not in ("time", "event")}
            lines.append(f"  {_clock(event.get('time'))} {event['event']} {json.dumps(extra) if extra else ''}".rstrip())
    return printable("\n".join(lines))  # reasons and names come from the run directory (rundir/terminal.py)


def _clock(stamp: Any) -> str:
    """ISO time of an event as local wall-clock time."""
    import datetime

    try:
        if isinstance(stamp, (int, float)):  # epoch seconds (the batch script's `date +%s`)
            moment = datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc)
        else:
            moment = datetime.datetime.fromisoformat(str(stamp))
        return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):
        return str(stamp)
