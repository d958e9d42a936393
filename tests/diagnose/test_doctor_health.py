"""Hang and requeue findings on recorded telemetry: timeouts, desync, stalls, budget, checkpoints, signals."""

from __future__ import annotations

import time

import pytest

from hpctrain.diagnose.doctor import diagnose_run
from hpctrain.launch.slurm.parsers import JobRecord

from ._runs import T0, assert_fixes_replan, event, gpu_job, healthy_telemetry, make_run, metrics_lines


def _only(run, family, **kwargs):
    findings = diagnose_run(run, **kwargs).findings
    assert [f.family for f in findings] == [family], [f.title for f in findings]
    return findings[0]


def test_nccl_watchdog_timeout_names_silent_rank_and_flight_recorder_dumps(tmp_path):
    metrics, ranks = healthy_telemetry()
    events = [event("started", 1.0, attempt=0), event("failed", 1500.0, attempt=0, reason="watchdog timeout")]
    logs = {(r, 0): "nccl_timeout.log" for r in range(3)}
    logs[(3, 0)] = "healthy.log"
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks, events=events, logs=logs)
    (run / "flight_recorder").mkdir()
    (run / "flight_recorder" / "nccl_trace_rank_0").write_bytes(b"\x80\x04")
    finding = _only(run, "hang")
    assert finding.severity == "error" and finding.title == "collective timeout (hang)"
    text = "\n".join(finding.evidence)
    assert "collective timeout on rank(s) 0, 1, 2 in attempt 0" in text
    assert "rank(s) 3 reported no timeout: the likely culprits" in text
    assert "the watchdog waited 600 s" in text
    assert "flight_recorder/nccl_trace_rank_0" in text
    assert finding.fixes == ()


def test_gloo_timeout_without_dumps_suggests_the_flight_recorder(tmp_path):
    run = make_run(tmp_path, gpu_job(), logs={(0, 0): "gloo_timeout.log"},
                   events=[event("started", 1.0, attempt=0), event("failed", 1900.0, attempt=0)])
    finding = _only(run, "hang")
    assert "no flight-recorder dumps in the run directory" in finding.evidence
    (fix,) = finding.fixes
    assert fix.sets[0] == 'nccl.env.TORCH_NCCL_DUMP_ON_TIMEOUT="1"'
    assert_fixes_replan(run, finding)


def test_desync_report(tmp_path):
    run = make_run(tmp_path, gpu_job(), logs={(1, 0): "desync.log"},
                   events=[event("started", 1.0, attempt=0), event("failed", 20.0, attempt=0)])
    finding = _only(run, "hang")
    assert "desync" in finding.title
    assert any("Detected mismatch between collectives" in line for line in finding.evidence)


def test_running_job_without_progress_for_30_minutes(tmp_path):
    metrics, ranks = healthy_telemetry()
    now = time.time()
    events = [{"time": now - 3600, "event": "started", "attempt": 0}]
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks, events=events, metrics_age_s=1800,
                   local_state={"state": "RUNNING"})
    finding = _only(run, "hang")
    assert finding.severity == "warning" and finding.title == "no progress for 30 minutes"
    assert "the last metrics line (step 20) and now (the run is still going)" in finding.evidence[0]
    assert any(f.sets == ("monitor.py_spy=true",) for f in finding.fixes)
    # the same run, recently active, is fine
    fresh = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks, events=events, metrics_age_s=30,
                     local_state={"state": "RUNNING"}, name="fresh")
    assert diagnose_run(fresh).findings == []


def test_requeue_budget_exhausted(tmp_path):
    events = [event("started", 0.0, attempt=0)]
    for attempt in range(1, 4):
        events += [event("requeued", attempt * 1000.0 - 10, attempt=attempt - 1, reason="preempted"),
                   event("started", attempt * 1000.0, attempt=attempt)]
    events.append(event("failed", 3900.0, attempt=3,
                        reason="preempted; not requeued: budget slurm.max_requeues=3 used"))
    metrics = metrics_lines(20, 2.2, mfu=0.42, tflops=135.0, attempt=3)
    run = make_run(tmp_path, gpu_job(checkpoint={"every_steps": 10}), metrics=metrics, events=events)
    findings = diagnose_run(run).findings
    budget = [f for f in findings if f.title == "requeue budget exhausted"]
    assert budget and budget[0].severity == "error"
    assert "3 restart(s) with restart.max_requeues=3" in budget[0].evidence[0]
    assert budget[0].fixes[0].sets == ("restart.max_requeues=6",)
    assert_fixes_replan(run, budget[0])


def test_checkpoints_too_rare_for_the_preemption_rate(tmp_path):
    events = [event("started", 0.0, attempt=0)]
    for attempt in range(1, 4):  # preempted every ~20 minutes
        events += [event("requeued", attempt * 1200.0 - 5, attempt=attempt - 1, reason="preempted"),
                   event("started", attempt * 1200.0, attempt=attempt)]
    events += [event("checkpoint saved", 4700.0, attempt=3, step=1000, duration_s=30.0),
               event("finished", 4800.0, attempt=3)]
    metrics = metrics_lines(20, 1.0, mfu=0.42, tflops=135.0, attempt=3)
    run = make_run(tmp_path, gpu_job(checkpoint={"every_steps": 1000}), metrics=metrics, events=events)
    finding = _only(run, "requeue")
    assert finding.title == "checkpoints are too rare for how often the job is interrupted"
    assert "3 interruption(s) in 80.0 min: one every 26.7 min on average" in finding.evidence[0]
    (fix,) = finding.fixes
    steps = int((2 * 30.0 * 1600.0) ** 0.5)  # Young: sqrt(2 C M) with C = 30 s, M = 1600 s, 1 s steps
    assert fix.sets == (f"checkpoint.every_steps={steps}",)
    assert_fixes_replan(run, finding)


def test_signal_too_late_to_save(tmp_path):
    events = [event("started", 0.0, attempt=0), event("checkpoint saved", 600.0, attempt=0, step=100, duration_s=45.0),
              event("signal", 3570.0, attempt=0, signal="USR2"), event("failed", 3600.0, attempt=0, reason="TIMEOUT")]
    run = make_run(tmp_path, gpu_job(slurm={"signal_seconds": 30}), metrics=metrics_lines(20, 2.2, mfu=0.42),
                   events=events)
    finding = _only(run, "requeue")
    assert finding.title == "the signal arrived too late to save a checkpoint"
    assert "attempt 0: signal USR2 30 s before it failed, no checkpoint saved in between" in finding.evidence[0]
    assert finding.fixes[0].sets == ("restart.signal_seconds=110",)
    assert_fixes_replan(run, finding)


@pytest.mark.parametrize("section", ["restart", "slurm"])  # slurm.*: the old name, in older run directories
def test_restart_values_are_read_under_both_names(tmp_path, section):
    events = [event("started", 0.0, attempt=0), event("checkpoint saved", 600.0, attempt=0, step=100, duration_s=45.0),
              event("signal", 3570.0, attempt=0, signal="USR2"), event("failed", 3600.0, attempt=0, reason="TIMEOUT")]
    run = make_run(tmp_path, gpu_job(**{section: {"signal_seconds": 40}}), metrics=metrics_lines(20, 2.2, mfu=0.42),
                   events=events)
    finding = _only(run, "requeue")
    assert "restart.signal_seconds=40;" in finding.evidence[-1]
    assert finding.fixes[0].sets == ("restart.signal_seconds=110",)


def test_time_limit_without_any_signal(tmp_path):
    def sacct(job_id):
        return [JobRecord(job_id, "TIMEOUT", exit_code="0:0")]

    events = [event("submitted", -10.0, executor="slurm", job_id="77"), event("started", 0.0, attempt=0)]
    run = make_run(tmp_path, gpu_job(), metrics=metrics_lines(20, 2.2, mfu=0.42), events=events)
    findings = diagnose_run(run, scheduler_query=sacct, now=T0 + 100).findings
    assert [f.title for f in findings] == ["the signal arrived too late to save a checkpoint"]


def test_finding8_a_full_disk_is_named_not_taken_for_a_comms_problem(tmp_path):
    reason = "no space left on device"
    events = [event("started", 0.0, attempt=0),
              event("checkpoint failed", 60.0, attempt=0, step=100, path="/scratch/ck/step-100.partial", reason=reason),
              event("failed", 61.0, attempt=0, exit_code=1,
                    reason=f"{reason} while saving checkpoint step 100 to /scratch/ck")]
    run = make_run(tmp_path, gpu_job(), metrics=metrics_lines(20, 2.2, mfu=0.42), events=events)
    finding = _only(run, "checkpoint")
    assert finding.severity == "error" and finding.title == f"a checkpoint save failed: {reason}"
    assert finding.evidence == (f"attempt 0: saving step 100 to /scratch/ck/step-100.partial: {reason}",)
    assert "make room in /scratch/ck" in finding.fixes[0].why


def test_finding3_a_stop_that_nothing_requeued_is_reported_and_its_saved_step_is_not_late(tmp_path):
    """A stray SIGTERM at step 16 of a local run: the step was already saved (every_steps) just before the
    signal, so the signal was not late; the run stopped unfinished and nothing requeued it."""
    import json

    events = [event("started", 0.0, attempt=0),
              event("checkpoint saved", 30.0, attempt=0, step=16, duration_s=1.0),
              event("signal", 30.5, attempt=0, signal="TERM", step=16),
              event("not_requeued", 30.5, attempt=0, reason="signal TERM at step 16", why_not="not-under-slurm",
                    step=16),
              event("stopped", 30.6, attempt=0, step=16, requeue="not-requeued", why_not="not-under-slurm"),
              event("ended", 31.0, state="STOPPED", attempt=0, executor="local")]
    run = make_run(tmp_path, gpu_job(train={"steps": 30}), metrics=metrics_lines(16, 2.2, mfu=0.42), events=events)
    (run / "submit").mkdir(exist_ok=True)
    (run / "submit" / "local.json").write_text(json.dumps({"state": "STOPPED", "reason": "signal TERM at step 16"}))
    finding = _only(run, "requeue")
    assert finding.severity == "error" and finding.title == "the run stopped at step 16 of 30 and nothing requeued it"
    assert "hpctrain resume" in finding.fixes[0].why
