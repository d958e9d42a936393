"""Read what a run left behind (docs/architecture.md: the run directory) into one object the rules share.

Nothing here writes to the run directory, and every file is optional: a run that is still
pending, crashed before its first step or was written by an older version still loads. A file
that is there but damaged (not UTF-8, a wrongly typed field) is a RunDirError, one line and exit 2
(hpctrain.rundir.read). Reading never imports torch, and never imports the launch stage: Slurm's
view of the job comes in as a `scheduler_query` from the caller.
"""

from __future__ import annotations

import datetime
import re
import statistics
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Optional

from hpctrain.rundir.events import ENDED, FAILED, FINISHED, REQUEUED, STARTED, STOPPED, SUBMITTED, read_jsonl
from hpctrain.rundir.layout import (
    EVENTS_FILE, JOB_FILE, LOGS_DIR, METRICS_FILE, PLAN_FILE, RANKS_DIR, RESOLVED_FILE,
)
from hpctrain.rundir.local_state import local_state_path, read_local_state
from hpctrain.rundir.process import is_recorded_process
from hpctrain.rundir.ranks import RANK_LOG, read_rank_summaries
from hpctrain.rundir.read import read_json, read_yaml_mapping
from hpctrain.rundir.safe_files import check_inside
from hpctrain.rundir.states import LIVE_SLURM_STATES

LOG_NAME = RANK_LOG
# What the run dir calls a still-running job (events) and what Slurm / the local executor call it.
ACTIVE_SCHEDULER_STATES = LIVE_SLURM_STATES
# job id -> records with job_id, state, exit_code, reason, restarts, nodes (launch.slurm.parsers.JobRecord)
SchedulerQuery = Callable[[str], list[Any]]


@dataclass(frozen=True)
class LogFile:
    rank: int
    attempt: int
    path: Path


@dataclass
class RunData:
    """One run directory, parsed. `now` is when it was read (for "no progress for N minutes")."""

    path: Path
    job_data: Optional[dict[str, Any]] = None  # job.resolved.yaml, else job.yaml
    submitted_data: Optional[dict[str, Any]] = None  # job.yaml as submitted
    plan: Optional[dict[str, Any]] = None  # plan.json
    metrics: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # `event` normalised, `t` epoch seconds
    logs: list[LogFile] = field(default_factory=list)
    scheduler: dict[str, Any] = field(default_factory=dict)  # state, exit_codes, reason, restarts
    metrics_mtime: Optional[float] = None
    now: float = field(default_factory=time.time)

    @cached_property
    def job(self) -> Any:
        """The validated resolved job, or None when it is missing or no longer validates."""
        if not self.job_data:
            return None
        from hpctrain.config import job_from_dict
        from hpctrain.errors import ConfigError

        try:
            return job_from_dict(self.job_data, origin=str(self.path / RESOLVED_FILE))
        except ConfigError:
            return None

    @property
    def layout(self) -> dict[str, Any]:
        """tp, pp, dp, micro_batch, schedule, virtual_stages, ac, zero of the run (resolved values)."""
        data = self.job_data or {}
        par, train = data.get("parallel") or {}, data.get("train") or {}
        return {"tp": par.get("tp"), "pp": par.get("pp"), "dp": par.get("dp"),
                "micro_batch": train.get("micro_batch"), "schedule": par.get("schedule"),
                "virtual_stages": par.get("virtual_stages"), "ac": train.get("activation_checkpointing"),
                "zero": par.get("zero"), "offload_optimizer": par.get("offload_optimizer", False)}

    @property
    def ended(self) -> bool:
        """The run is over (finished, failed, cancelled), as far as events and the scheduler say."""
        state = self.scheduler.get("state")
        if state and self.scheduler.get("source") == "local executor":
            return state not in ("PENDING", "RUNNING")  # its STOPPED has ended (Slurm's is a SIGSTOPped job)
        if state:
            return state not in ACTIVE_SCHEDULER_STATES
        last = self.last_lifecycle_event()
        return last is not None and last["event"] in (FINISHED, FAILED, CANCELLED)

    def last_lifecycle_event(self) -> Optional[dict[str, Any]]:
        """The newest started / finished / failed / cancelled / requeued event (the launcher's
        `ended` event counts as the outcome its state names)."""
        kinds = (STARTED, FINISHED, FAILED, CANCELLED, REQUEUED)
        chosen = [lifecycle(e) for e in self.events if lifecycle(e)["event"] in kinds]
        return chosen[-1] if chosen else None

    def events_named(self, *names: str) -> list[dict[str, Any]]:
        """Events with one of these names, compared as normalize_event spells them (`ended` counts under the
        outcome its state names)."""
        wanted = {event_name(name) for name in names}
        return [e for e in map(lifecycle, self.events) if e["event"] in wanted]

    def steady_metrics(self) -> list[dict[str, Any]]:
        """Metrics lines without each attempt's first (warm-up) line, when there are others."""
        out, seen = [], set()
        for record in self.metrics:
            attempt = record.get("attempt", 0)
            if attempt not in seen:
                seen.add(attempt)
                continue
            out.append(record)
        return out or list(self.metrics)

    def median_metric(self, key: str) -> Optional[float]:
        values = [float(r[key]) for r in self.steady_metrics() if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    def attempts(self) -> list[int]:
        """Attempts seen in logs, metrics and events (0 for a run that never restarted)."""
        seen = {log.attempt for log in self.logs} | {int(r.get("attempt") or 0) for r in self.metrics}
        seen |= {int(e["attempt"]) for e in self.events if isinstance(e.get("attempt"), int)}
        return sorted(seen) or [0]


def lifecycle(event: dict[str, Any]) -> dict[str, Any]:
    """`ended` (state COMPLETED / FAILED / CANCELLED / STOPPED / TIMEOUT ...) as finished / failed / cancelled /
    stopped."""
    if event["event"] != ENDED:
        return event
    state = str(event.get("state") or "").upper()
    name = {"COMPLETED": FINISHED, "CANCELLED": CANCELLED, "STOPPED": STOPPED}.get(state, FAILED)
    return {**event, "event": name}


def event_time_s(value: Any) -> Optional[float]:
    """Epoch seconds from the launcher's float or the runtime's ISO-8601 string."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            stamp = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.timezone.utc)
        return stamp.timestamp()
    return None


# The outcome of an `ended` event whose state is CANCELLED, as lifecycle() names it (no writer uses the name).
CANCELLED = "cancelled"


def event_name(name: object) -> str:
    """`checkpoint saved` / `checkpoint-saved` -> `checkpoint_saved`: how the rules compare event names."""
    return re.sub(r"[\s\-]+", "_", str(name).strip().lower())


def normalize_event(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its name as event_name spells it, and `t` (epoch seconds)."""
    return {**record, "event": event_name(record.get("event", "")), "t": event_time_s(record.get("time"))}


def _list_logs(run_dir: Path) -> list[LogFile]:
    logs_dir = run_dir / LOGS_DIR
    if not logs_dir.is_dir():
        return []
    found = [LogFile(int(m.group(1)), int(m.group(2)), p) for p in logs_dir.iterdir() if (m := LOG_NAME.match(p.name))]
    return sorted(found, key=lambda log: (log.attempt, log.rank))


def _scheduler_view(run_dir: Path, events: list[dict[str, Any]], query: Optional[SchedulerQuery]) -> dict[str, Any]:
    """The local executor's state file, else Slurm's record of the job (when a query is given)."""
    local = read_local_state(run_dir)
    if local and local.get("state"):
        state, reason = str(local["state"]).upper(), local.get("reason")
        pid = local.get("pid")
        if state in ("PENDING", "RUNNING") and isinstance(pid, int) and not is_recorded_process(
                pid, run_dir, local.get("pid_start"), patience_s=0.2):
            state, reason = "FAILED", "the local supervisor process is gone"  # as `status` says (launch.local.executor)
        return {"state": state, "exit_codes": local.get("exit_codes") or [], "reason": reason,
                "source": "local executor"}
    submitted = [e for e in events if e["event"] == SUBMITTED and e.get("job_id")]
    if not submitted or query is None:
        return {}
    job_id = str(submitted[-1]["job_id"])
    try:
        records = query(job_id)
    except Exception:  # noqa: BLE001 - the scheduler is a hint; the run dir alone must still diagnose
        return {}
    mine = [r for r in records if r.job_id == job_id] or records[:1]
    if not mine:
        return {}
    record = mine[0]
    return {"state": record.state, "exit_codes": [record.exit_code] if record.exit_code else [],
            "reason": record.reason, "restarts": record.restarts, "nodes": record.nodes, "source": "slurm"}


def load_run(path: str | Path, *, scheduler_query: Optional[SchedulerQuery] = None,
             now: Optional[float] = None) -> RunData:
    """Parse a run directory. `scheduler_query` (job id -> records) adds Slurm's state of the job."""
    run_dir = Path(path)
    logs = _list_logs(run_dir)
    # What the doctor and the report show comes from inside the run: a link out of it is refused (one line).
    check_inside(run_dir, [*(run_dir / name for name in (EVENTS_FILE, METRICS_FILE, JOB_FILE, RESOLVED_FILE,
                                                         PLAN_FILE)),
                           local_state_path(run_dir), *sorted((run_dir / RANKS_DIR).glob("*.json")),
                           *(log.path for log in logs)])
    events = [normalize_event(e) for e in read_jsonl(run_dir / EVENTS_FILE)]
    metrics_path = run_dir / METRICS_FILE
    metrics = [m for m in read_jsonl(metrics_path) if isinstance(m.get("step"), int)]
    submitted = read_yaml_mapping(run_dir / JOB_FILE)
    return RunData(
        path=run_dir,
        job_data=read_yaml_mapping(run_dir / RESOLVED_FILE) or submitted,
        submitted_data=submitted,
        plan=read_json(run_dir / PLAN_FILE),
        metrics=metrics,
        ranks=read_rank_summaries(run_dir),
        events=events,
        logs=logs,
        scheduler=_scheduler_view(run_dir, events, scheduler_query),
        metrics_mtime=metrics_path.stat().st_mtime if metrics_path.is_file() else None,
        now=time.time() if now is None else now,
    )
