"""Hangs and restarts: watchdog timeouts, desync, no progress, and the requeue policy.

Requeue arithmetic: with interruptions every M seconds on average and a checkpoint every T seconds,
each interruption loses T/2 of work on average; the doctor flags T/2 above `lost_work_share` of M
and proposes Young's interval sqrt(2 C M) (Young 1974, "A first order approximation to the optimum
checkpoint interval"), C being the measured save time, or M/10 when C is unknown.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from hpctrain.diagnose.context import Context
from hpctrain.diagnose.findings import ERROR, WARNING, Finding, Fix, ranks_text
from hpctrain.diagnose.fixes import validated
from hpctrain.diagnose.logscan import first_per_rank, flight_recorder_dumps
from hpctrain.diagnose.rundata import CANCELLED, lifecycle
from hpctrain.rundir.events import (
    CHECKPOINT_FAILED, FAILED, FINISHED, NOT_REQUEUED, REQUEUED, SIGNAL, STARTED, STOPPED, TIME_LIMIT_NEAR,
    WHY_NOT_REQUEUED,
)

_OP = re.compile(r"SeqNum=(\d+).*?OpType=(\w+)")
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)|ran for (\d+) milliseconds|waiting (\d+) ?ms")
FR_ENV = ("nccl.env.TORCH_NCCL_DUMP_ON_TIMEOUT=\"1\"", "nccl.env.TORCH_NCCL_TRACE_BUFFER_SIZE=\"2000\"")


def _flight_recorder(ctx: Context) -> tuple[list[str], list[Fix]]:
    dumps = flight_recorder_dumps(ctx.run.path, ctx.matches)
    if dumps:
        shown = ", ".join(dumps[:4]) + (f" (+{len(dumps) - 4})" if len(dumps) > 4 else "")
        return [f"flight-recorder dumps: {shown} (read them with `python -m torch.distributed.flight_recorder.fr_trace "
                "<folder>`)"], []
    fix = validated("record the last collectives of every rank on the next timeout (flight recorder)",
                    [*FR_ENV, f"nccl.env.TORCH_NCCL_DEBUG_INFO_TEMP_FILE={ctx.run.path}/flight_recorder/"
                                          "nccl_trace_rank_"],
                    ctx.run.job_data)
    return ["no flight-recorder dumps in the run directory"], [fix] if fix else []


def hang_rule(ctx: Context) -> list[Finding]:
    """NCCL/gloo watchdog timeouts and desync reports in the logs."""
    timeouts = first_per_rank(ctx.matches, "timeout")
    desync = first_per_rank(ctx.matches, "desync")
    if not timeouts and not desync:
        return []
    evidence: list[str] = []
    attempt = max(m.attempt for m in timeouts + desync)
    if timeouts:
        ranks = sorted({m.rank for m in timeouts if m.attempt == attempt})
        evidence.append(f"collective timeout on rank(s) {ranks_text(ranks)} in attempt {attempt}")
        evidence.append(f"{timeouts[0].where()}: {timeouts[0].text[:200]}")
        ops = {m.rank: _OP.search(m.text) for m in timeouts if m.attempt == attempt}
        seqs = {rank: (int(op.group(1)), op.group(2)) for rank, op in ops.items() if op}
        if len(set(seqs.values())) > 1:
            evidence.append("ranks disagree on the collective (desync): " + ", ".join(
                f"rank {r} at #{s} {kind}" for r, (s, kind) in sorted(seqs.items())))
        logged = {log.rank for log in ctx.run.logs if log.attempt == attempt}
        silent = sorted(logged - {m.rank for m in timeouts if m.attempt == attempt})
        if silent and ranks:
            evidence.append(f"rank(s) {ranks_text(silent)} reported no timeout: the likely culprits (stuck before the "
                            "collective, crashed, or on a slow/failed node)")
        waited = _TIMEOUT_MS.search(timeouts[0].text)
        if waited:
            ms = next(g for g in waited.groups() if g)
            evidence.append(f"the watchdog waited {int(ms) / 1000:.0f} s")
    if desync:
        evidence.append(f"desync report: {desync[0].where()}: {desync[0].text[:200]}")
    fr_lines, fixes = _flight_recorder(ctx)
    evidence += fr_lines
    desynced = desync or "desync" in " ".join(evidence)
    title = "collective timeout (hang)" + (" with a desync between ranks" if desynced else "")
    return [Finding("hang", ERROR, title, tuple(evidence), tuple(fixes))]


def _last_progress(ctx: Context) -> Optional[tuple[float, str]]:
    run = ctx.run
    if run.metrics_mtime is not None and run.metrics:
        return run.metrics_mtime, f"last metrics line (step {run.metrics[-1]['step']})"
    started = [e["t"] for e in run.events_named(STARTED) if e.get("t")]
    return (started[-1], "start of the attempt (no step logged yet)") if started else None


def stall_rule(ctx: Context) -> list[Finding]:
    """No new step for `stall_minutes` (or 20 logging intervals) while running, or before the end."""
    run = ctx.run
    if not run.events_named(STARTED):
        return []  # never started: pending, or failed before the ranks ran
    if any(m.kind in ("timeout", "desync") for m in ctx.matches):
        return []  # hang_rule explains this stall better
    progress = _last_progress(ctx)
    if progress is None:
        return []
    last = run.last_lifecycle_event()
    if run.ended:
        if last is None or last["event"] == FINISHED or not last.get("t"):
            return []
        until, what = float(last["t"]), f"the run {last['event']}"
    else:
        until, what = run.now, "now (the run is still going)"
    step_s = run.median_metric("step_time_s") or 0.0
    log_every = int(ctx.section("train").get("log_every") or 1)
    limit_s = max(ctx.thresholds.stall_minutes * 60.0, 20.0 * step_s * log_every)
    idle_s = until - progress[0]
    if idle_s <= limit_s:
        return []
    evidence = [f"{idle_s / 60:.1f} min between the {progress[1]} and {what}; limit {limit_s / 60:.1f} min",
                f"median step time {step_s:.3f} s, a metrics line every {log_every} step(s)" if step_s else
                "no step time measured yet"]
    fr_lines, fixes = _flight_recorder(ctx)
    evidence += fr_lines
    spy = validated("dump every rank's Python stack before the time limit (py-spy)", ["monitor.py_spy=true"],
                    ctx.run.job_data)
    if spy and not ctx.section("monitor").get("py_spy"):
        fixes.append(spy)
    return [Finding("hang", ERROR if run.ended else WARNING, f"no progress for {idle_s / 60:.0f} minutes",
                    tuple(evidence), tuple(fixes))]


def _restarts(ctx: Context) -> int:
    run = ctx.run
    counted = [len(run.events_named(REQUEUED)), max(run.attempts()), int(run.scheduler.get("restarts") or 0)]
    return max(counted)


def restart_value(ctx: Context, name: str, default: int) -> int:
    """restart.NAME of the run's job, else slurm.NAME (its old name, in older run directories), else the default."""
    for section in ("restart", "slurm"):
        value = ctx.section(section).get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def requeue_budget_rule(ctx: Context) -> list[Finding]:
    """The job used up restart.max_requeues and did not finish."""
    run = ctx.run
    budget = restart_value(ctx, "max_requeues", 3)
    restarts = _restarts(ctx)
    said = [e for e in run.events if re.search(r"budget|max_requeues", str(e.get("reason") or ""), re.IGNORECASE)]
    finished = bool(run.events_named(FINISHED))
    if finished or not run.ended or (restarts < budget and not said):
        return []
    evidence = [f"{restarts} restart(s) with restart.max_requeues={budget}; the run ended without finishing"]
    evidence += [f"{e['event']} (attempt {e.get('attempt', '?')}): {e.get('reason')}" for e in said[:3]]
    reasons = [f"attempt {e.get('attempt', '?')}: {e['event']}" + (f" ({e.get('reason')})" if e.get("reason") else "")
               for e in run.events_named(REQUEUED, FAILED, STOPPED)][-5:]
    evidence += reasons
    fix = validated("allow more requeues (and fix what keeps interrupting the job, listed above)",
                    [f"restart.max_requeues={max(2 * budget, budget + 3)}"], run.job_data)
    return [Finding("requeue", ERROR, "requeue budget exhausted", tuple(evidence), (fix,) if fix else ())]


def stopped_rule(ctx: Context) -> list[Finding]:
    """The ranks stopped early on a signal (or a near limit), saved, and nothing requeued them: no cancel was
    asked for, so the run is unfinished work, not a success (a local run, a lost requeue, requeue disabled)."""
    run = ctx.run
    kinds = (STARTED, STOPPED, FINISHED, FAILED, CANCELLED, REQUEUED)
    ends = [e for e in map(lifecycle, run.events) if e["event"] in kinds]
    if not run.ended or not ends or ends[-1]["event"] != STOPPED:
        return []
    stops = run.events_named(STOPPED)
    step = next((e.get("step") for e in reversed(stops) if e.get("step") is not None), None)
    refused = run.events_named(NOT_REQUEUED)
    if refused and refused[-1].get("why_not") == "max-requeues-reached":
        return []  # requeue_budget_rule says it, with its fix
    steps = ctx.section("train").get("steps")
    evidence = [f"{e['event']} (attempt {e.get('attempt', '?')}): " + str(e.get("reason") or e.get("signal") or "")
                for e in run.events_named(SIGNAL, TIME_LIMIT_NEAR, NOT_REQUEUED)[-3:]]
    fix = Fix(f"continue from its last checkpoint: `hpctrain resume {run.path}`")
    return [Finding("requeue", ERROR, f"the run stopped at step {step} of {steps or '?'} and nothing requeued it",
                    tuple(evidence), (fix,))]


def _save_seconds(ctx: Context) -> Optional[float]:
    """Median time a checkpoint save blocked, when events say so."""
    values = [float(e[k]) for e in ctx.run.events_named("checkpoint_saved") for k in ("duration_s", "save_s", "seconds")
              if isinstance(e.get(k), (int, float))]
    return sorted(values)[len(values) // 2] if values else None


def checkpoint_interval_rule(ctx: Context) -> list[Finding]:
    """Checkpoints too rare for the observed rate of interruptions."""
    run = ctx.run
    restarts = _restarts(ctx)
    starts = [e["t"] for e in run.events_named(STARTED) if e.get("t")]
    ends = [e["t"] for e in run.events if e.get("t")]
    step_s = run.median_metric("step_time_s")
    every = int(ctx.section("checkpoint").get("every_steps") or 0)
    if restarts < 1 or not starts or not step_s or not every:
        return []
    wall_s = (run.now if not run.ended else max(ends)) - min(starts)
    mtbi_s = wall_s / restarts
    interval_s = every * step_s
    if interval_s / 2 <= ctx.thresholds.lost_work_share * mtbi_s:
        return []
    save_s = _save_seconds(ctx)
    target_s = math.sqrt(2 * save_s * mtbi_s) if save_s else ctx.thresholds.lost_work_share * mtbi_s
    steps = max(1, int(target_s / step_s))
    evidence = [f"{restarts} interruption(s) in {wall_s / 60:.1f} min: one every {mtbi_s / 60:.1f} min on average",
                f"a checkpoint every {every} steps x {step_s:.3f} s = {interval_s / 60:.1f} min: each interruption "
                f"loses {interval_s / 120:.1f} min of work on average",
                (f"saving takes {save_s:.1f} s: Young's interval sqrt(2 x save x MTBI) = {target_s / 60:.1f} min"
                 if save_s else f"target: lose at most {ctx.thresholds.lost_work_share:.0%} of the time between "
                                "interruptions")]
    fix = validated(f"checkpoint every {steps} steps (~{steps * step_s / 60:.1f} min)",
                    [f"checkpoint.every_steps={steps}"], run.job_data)
    return [Finding("requeue", WARNING, "checkpoints are too rare for how often the job is interrupted",
                    tuple(evidence), (fix,) if fix else ())]


def _attempt_end(ctx: Context, attempt: Any, after: float) -> Optional[dict[str, Any]]:
    for event in map(lifecycle, ctx.run.events):
        if event.get("t") and event["t"] >= after and (
                event["event"] in (FAILED, REQUEUED, STOPPED, CANCELLED, FINISHED)
                or (event["event"] == STARTED and event.get("attempt") != attempt)):
            return event
    return None


def signal_rule(ctx: Context) -> list[Finding]:
    """The pre-limit signal came too late to save a checkpoint before the job was stopped."""
    run = ctx.run
    late: list[str] = []
    for signal in run.events_named(SIGNAL):
        if not signal.get("t"):
            continue
        end = _attempt_end(ctx, signal.get("attempt"), signal["t"])
        saved = [e for e in run.events_named("checkpoint_saved") if e.get("t") and e["t"] >= signal["t"]
                 and (end is None or e["t"] <= end["t"])]
        # The step the ranks stopped at may have been saved just before the signal (checkpoint.every_steps):
        # nothing was lost, so the signal was not late.
        saved += [e for e in run.events_named("checkpoint_saved") if signal.get("step") is not None
                  and e.get("step") == signal.get("step") and e.get("attempt") == signal.get("attempt")]
        if end is not None and not saved:
            late.append(f"attempt {signal.get('attempt', '?')}: signal {signal.get('signal', '')} "
                        f"{end['t'] - signal['t']:.0f} s before it {end['event']}, no checkpoint saved in between")
    if run.scheduler.get("state") == "TIMEOUT" and not run.events_named(SIGNAL):
        late.append("Slurm stopped the job at its time limit (TIMEOUT) and no signal was recorded")
    if not late:
        return []
    step_s = run.median_metric("step_time_s") or 0.0
    save_s = _save_seconds(ctx) or 60.0
    now_s = restart_value(ctx, "signal_seconds", 120)
    needed = int(math.ceil((save_s + 2 * step_s + 60) / 10.0) * 10)
    evidence = late + [f"restart.signal_seconds={now_s}; a save needs ~{save_s:.0f} s plus up to one step "
                       f"({step_s:.1f} s) to reach a step boundary; Slurm delivers the signal up to ~60 s late"]
    fix = validated("send the signal earlier", [f"restart.signal_seconds={max(needed, 2 * now_s)}"], run.job_data)
    return [Finding("requeue", ERROR, "the signal arrived too late to save a checkpoint", tuple(evidence),
                    (fix,) if fix else ())]


def not_requeued_rule(ctx: Context) -> list[Finding]:
    """The batch script refused to requeue: a rank said its input is wrong (exit 2), or the job failed again at
    the step it failed at before the requeue. Either way another try would fail the same way."""
    from hpctrain.rundir.layout import BAD_INPUT_MARKER
    from hpctrain.rundir.read import read_text

    refused = [e for e in ctx.run.events_named(NOT_REQUEUED) if e.get("why_not") in ("bad-input", "same-step")]
    if not refused:
        return []
    event = refused[-1]
    why = str(event["why_not"])
    evidence = [f"{NOT_REQUEUED} (attempt {event.get('attempt', '?')}, exit {event.get('exit_code', '?')}): "
                f"{WHY_NOT_REQUEUED[why]}"]
    if why == "bad-input":
        said = (read_text(ctx.run.path / BAD_INPUT_MARKER) or "").splitlines()
        evidence += said[:4]
        title = "a rank refused the job's input (exit 2); not requeued"
    else:
        evidence.append(f"both attempts ended at step {event.get('step')}; see `hpctrain logs {ctx.run.path}`")
        title = f"failed again at step {event.get('step')} after a requeue; not requeued"
    return [Finding("requeue", ERROR, title, tuple(evidence), ())]


def checkpoint_failed_rule(ctx: Context) -> list[Finding]:
    """A checkpoint save that failed (a full disk, a quota, an unwritable folder), named as what it was: the
    runtime's `checkpoint failed` event (issue 18 finding 8), not the collective errors it causes."""
    failed = ctx.run.events_named(CHECKPOINT_FAILED)
    if not failed:
        return []
    last = failed[-1]
    reason = str(last.get("reason") or "unknown cause")
    folder = str(last.get("path") or "").rsplit("/", 1)[0] or "the checkpoint folder"
    evidence = [f"attempt {e.get('attempt', '?')}: saving step {e.get('step', '?')} to {e.get('path', '?')}: "
                f"{e.get('reason', '?')}" for e in failed[-3:]]
    fix = Fix(f"make room in {folder} (or set checkpoint.dir to a larger file system), then "
              f"`hpctrain resume {ctx.run.path}`: the checkpoints saved before this one are intact")
    return [Finding("checkpoint", ERROR, f"a checkpoint save failed: {reason}", tuple(evidence), (fix,))]


def failed_rule(ctx: Context, others: list[Finding]) -> list[Finding]:
    """The run ended failed and a rank recorded why (a `failed` event): that reason, first. Bad input (exit 2:
    a token file, a config.json, damaged weights) is always reported, since no other rule knows of it; another
    failure only when no other rule found anything (the doctor never says "no problems found" of a failed run
    that recorded why)."""
    run = ctx.run
    kinds = (STARTED, STOPPED, FINISHED, FAILED, CANCELLED, REQUEUED)
    ends = [e for e in map(lifecycle, run.events) if e["event"] in kinds]
    if not run.ended or not ends or ends[-1]["event"] != FAILED:
        return []
    starts = [i for i, e in enumerate(ends) if e["event"] == STARTED]
    last = ends[starts[-1]:] if starts else ends
    recorded = [e for e in last if e["event"] == FAILED and "state" not in e and e.get("reason")]
    if not recorded:
        return []
    # the rank that refused its input, not a peer that then lost its connection (DistNetworkError)
    bad_input = [e for e in recorded if e.get("exit_code") == 2]
    first = (bad_input or recorded)[0]
    if not bad_input and others:
        return []
    reason = str(first["reason"]).splitlines()[0]
    ranks: list[int] = sorted({int(e["rank"]) for e in recorded if str(e.get("reason")).splitlines()[0] == reason
                               and isinstance(e.get("rank"), int)})
    evidence = [f"recorded by {'rank(s) ' + ranks_text(ranks) if ranks else 'the run'} (attempt {first.get('attempt', '?')}, "
                f"exit code {first.get('exit_code', '?')})"]
    evidence += [f"rank {e.get('rank', '?')}: {str(e['reason']).splitlines()[0]}" for e in recorded
                 if str(e["reason"]).splitlines()[0] != reason][:3]
    fixes: tuple[Fix, ...] = ()
    if bad_input:
        fixes = (Fix(f"fix what the line names, then start again from the job file (or `hpctrain resume "
                     f"{run.path}` when it has checkpoints)"),)
        title = f"the run refused its input: {reason}"
    else:
        title = f"the run failed: {reason}"
    return [Finding("failed", ERROR, title, tuple(evidence), fixes)]
