"""Out-of-memory findings on recorded telemetry: CUDA OOM, host OOM (Slurm state, markers), SIGKILL."""

from __future__ import annotations

from hpctrain.config import job_from_dict
from hpctrain.diagnose.doctor import diagnose_run
from hpctrain.diagnose.predict import predict_job
from hpctrain.launch.slurm.parsers import JobRecord

from ._runs import GIB, assert_fixes_replan, event, gpu_job, healthy_telemetry, make_run, metrics_lines, rank_summary

# The planner predicts ~60 GiB of 80 for this layout (mb=4, no recompute); the run measured 79 GiB.
OOM_JOB = gpu_job(train={"micro_batch": 4, "activation_checkpointing": "none"}, parallel={"tp": 1, "dp": 8})


def test_healthy_run_has_no_findings(tmp_path):
    metrics, ranks = healthy_telemetry()
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks,
                   logs={(0, 0): "healthy.log", (1, 0): "healthy.log"},
                   local_state={"state": "COMPLETED", "exit_codes": [0] * 8})
    diagnosis = diagnose_run(run)
    assert diagnosis.findings == [], [f.title for f in diagnosis.findings]
    assert diagnosis.state == "finished"
    assert diagnosis.prediction_label.startswith("tp=2 pp=1 dp=4 mb=2")


def test_cuda_oom_compares_peak_with_plan_and_fixes_fit(tmp_path):
    ranks = [rank_summary(r, step_time_s=3.6, peak_bytes=(79 if r == 3 else 70) * GIB, host=f"gpu-a{r // 4}")
             for r in range(8)]
    events = [event("started", 1.0, attempt=0), event("failed", 30.0, attempt=0, rank=3,
                                                      reason="OutOfMemoryError: CUDA out of memory.")]
    run = make_run(tmp_path, OOM_JOB, metrics=metrics_lines(1, 3.6, peak_bytes=70 * GIB), ranks=ranks, events=events,
                   logs={(3, 0): "cuda_oom.log", (0, 0): "healthy.log"})
    (finding,) = diagnose_run(run).findings
    predicted = predict_job(job_from_dict(OOM_JOB)).total_bytes
    assert (finding.family, finding.severity, finding.title) == ("oom", "error", "CUDA out of memory")
    text = "\n".join(finding.evidence)
    assert "rank(s) 3 (host gpu-a0)" in text
    assert "asked for 2.00 GiB with 75.21 GiB already allocated" in text
    assert "measured peak 79.00 GiB (rank 3 on gpu-a0)" in text
    assert f"planner predicted {predicted / GIB:.2f} GiB of a 80.00 GiB budget" in text
    scale = 79 * GIB / predicted
    assert f"measured / predicted = {scale:.2f}" in text and scale > 1
    sets = [fix.sets for fix in finding.fixes]
    assert sets and len(sets) <= 4
    assert ("train.micro_batch=2",) in sets or ("train.activation_checkpointing=selective",) in sets
    for fix in finding.fixes:  # each one fits even scaled by the measured overshoot
        used, budget = fix.predicted.split(": ", 1)[1].split(" GiB")[0].split(" of ")
        assert float(used) * scale <= float(budget) + 0.1
    assert_fixes_replan(run, finding)


def test_host_oom_from_slurm_state_and_stepd_message(tmp_path):
    def sacct(job_id):
        return [JobRecord(job_id, "OUT_OF_MEMORY", exit_code="0:125", restarts=0)]

    events = [event("submitted", 0.0, executor="slurm", job_id="4182"), event("started", 5.0, attempt=0)]
    run = make_run(tmp_path, gpu_job(), events=events, logs={(1, 0): "oom_kill.log"},
                   metrics=metrics_lines(20, 2.2, mfu=0.42), ranks=healthy_telemetry()[1])
    (finding,) = diagnose_run(run, scheduler_query=sacct).findings
    assert finding.family == "oom" and finding.severity == "error"
    assert "host (CPU) memory" in finding.title
    text = "\n".join(finding.evidence)
    assert "Slurm state OUT_OF_MEMORY" in text and "oom_kill event" in text
    assert finding.fixes
    assert_fixes_replan(run, finding)


def test_sigkill_without_an_oom_message_is_a_kill_not_an_oom(tmp_path):
    # Issue 29: after a `kill -9` of a rank the doctor said "the allocation failed at 0.05 GiB, below the
    # planner's 16.00 GiB budget" and offered more nodes: an OOM story with no OOM anywhere in the run.
    events = [event("started", 1.0, attempt=0), event("failed", 50.0, attempt=0, reason="rank 1 exited with code -9",
                                                      executor="local")]
    metrics, ranks = healthy_telemetry()
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks, events=events,
                   logs={(0, 0): "healthy.log", (1, 0): "healthy.log"},
                   local_state={"state": "FAILED", "exit_codes": [-15, -9], "reason": "rank 1 exited with code -9"})
    (finding,) = diagnose_run(run).findings
    assert (finding.family, finding.severity, finding.title) == ("killed", "warning",
                                                                "a rank was killed by signal 9 (SIGKILL)")
    text = "\n".join(finding.evidence)
    assert "exit codes -15, -9" in text and "no out-of-memory message in the rank logs" in text
    assert "allocation failed" not in text and "budget" not in text
    assert finding.fixes == ()  # no memory fixes for a failure nobody showed to be memory


def test_sigkill_with_an_oom_kill_in_the_logs_is_a_host_oom(tmp_path):
    events = [event("started", 1.0, attempt=0), event("failed", 50.0, attempt=0, reason="rank 1 exited with code -9")]
    metrics, ranks = healthy_telemetry()
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks, events=events, logs={(1, 0): "oom_kill.log"},
                   local_state={"state": "FAILED", "exit_codes": [-15, -9], "reason": "rank 1 exited with code -9"})
    (finding,) = diagnose_run(run).findings
    assert finding.family == "oom" and "host (CPU) memory" in finding.title


def test_sigkill_in_a_run_that_finished_is_not_reported(tmp_path):
    metrics, ranks = healthy_telemetry()
    events = [event("started", 1.0, attempt=0), event("failed", 50.0, attempt=0, reason="rank 1 exited with code -9"),
              event("started", 80.0, attempt=1), event("finished", 3000.0, attempt=1)]
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks, events=events,
                   local_state={"state": "COMPLETED", "exit_codes": [0, 0]})
    assert [f.family for f in diagnose_run(run).findings] == []
