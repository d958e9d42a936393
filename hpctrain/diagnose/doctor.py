"""`hpctrain doctor`: run every rule over a run directory (or each run of a sweep) and collect findings.

Rules are plain functions `rule(ctx) -> list[Finding]`, one per finding family, in the order their
findings are printed within a severity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hpctrain.diagnose import rules_eval, rules_health, rules_memory, rules_moe, rules_perf
from hpctrain.diagnose.context import Context, Thresholds
from hpctrain.diagnose.findings import Finding, format_findings, sort_findings
from hpctrain.diagnose.fixes import FixChecker
from hpctrain.diagnose.logscan import PATTERNS, scan_logs
from hpctrain.diagnose.predict import predict_run
from hpctrain.diagnose.rundata import RunData, SchedulerQuery, load_run
from hpctrain.rundir.events import LAYOUT_CHANGED, SUBMITTED
from hpctrain.rundir.terminal import printable

Rule = Callable[[Context], list[Finding]]

RULES: tuple[Rule, ...] = (
    rules_memory.oom_rule,
    rules_health.hang_rule,
    rules_health.stall_rule,
    rules_health.requeue_budget_rule,
    rules_health.stopped_rule,
    rules_health.not_requeued_rule,
    rules_health.signal_rule,
    rules_health.checkpoint_interval_rule,
    rules_health.checkpoint_failed_rule,
    rules_eval.training_divergence_rule,
    rules_eval.validation_rule,
    rules_moe.router_collapse_rule,
    rules_perf.comm_rule,
    rules_perf.imbalance_rule,
    rules_perf.bubble_rule,
    rules_perf.mfu_rule,
    rules_perf.throughput_rule,
)


@dataclass
class Diagnosis:
    """The findings of one run, with what the doctor knew about it."""

    run_dir: Path
    findings: list[Finding]
    state: str
    prediction_label: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "state": self.state, "planned_layout": self.prediction_label,
                "findings": [f.to_json() for f in self.findings], "notes": self.notes}


def run_state(run: RunData) -> str:
    """running / finished / failed / cancelled / pending / unknown, from the scheduler and the events."""
    state = run.scheduler.get("state")
    if state:
        return {"COMPLETED": "finished", "RUNNING": "running", "PENDING": "pending"}.get(state, state.lower())
    last = run.last_lifecycle_event()
    if last is None:
        return "pending" if run.events_named(SUBMITTED) else "unknown"
    return {"started": "running", "requeued": "requeued"}.get(last["event"], last["event"])


def build_context(run: RunData, thresholds: Thresholds = Thresholds(),
                  plan_job: Optional[Callable[[Any], Any]] = None) -> Context:
    """The shared inputs of the rules: prediction, fix checker (when the job is known), log matches."""
    prediction, problem = predict_run(run.job_data, run.plan)
    checker = None
    if run.job_data:
        checker = FixChecker(run.job_data, run.submitted_data)
        if plan_job is not None:
            checker.plan_job = plan_job
    matches = scan_logs(run.logs, PATTERNS)
    return Context(run, prediction, problem, checker, matches, thresholds)


def diagnose_run(path: str | Path, *, thresholds: Thresholds = Thresholds(),
                 scheduler_query: Optional[SchedulerQuery] = None, now: Optional[float] = None) -> Diagnosis:
    """All findings for one run directory (finished, failed or still running)."""
    run = load_run(path, scheduler_query=scheduler_query, now=now)
    ctx = build_context(run, thresholds)
    findings: list[Finding] = []
    for rule in RULES:
        findings += rule(ctx)
    notes = []
    if ctx.prediction is None and ctx.prediction_problem:
        notes.append(f"no planner prediction: {ctx.prediction_problem}")
    from hpctrain.rundir.layouts import describe

    for change in run.events_named(LAYOUT_CHANGED):  # an elastic job re-planned for the nodes it got
        notes.append(f"layout changed at attempt {change.get('attempt')}: {describe(change.get('old') or {})} -> "
                     f"{describe(change.get('new') or {})} (the figures above are for the current layout)")
    if not run.metrics and not run.ranks:
        notes.append("no telemetry yet (metrics.jsonl, ranks/): only logs, events and the scheduler were checked")
    return Diagnosis(Path(path), sort_findings(findings), run_state(run),
                     ctx.prediction.label if ctx.prediction else None, notes)


def format_diagnosis(diagnosis: Diagnosis) -> str:
    label = f"{diagnosis.run_dir} ({diagnosis.state})"
    text = format_findings(diagnosis.findings, label)
    if diagnosis.notes:
        text += "\n" + "\n".join(f"note: {note}" for note in diagnosis.notes)
    return printable(text)  # evidence quotes logs and events of the run directory (rundir/terminal.py)
