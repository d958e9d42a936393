"""Issue 30 Why 9: the doctor said "no problems found" on a run that failed with exit 2 on bad data although
events.jsonl held the reason; it reports the recorded reason first now, and the rank that refused its input
rather than a peer that then lost its connection.

The events are written by hand in the shapes runtime/__main__.py writes them: which rank's `failed` lands
first is a race in a real run (rank 1's DistNetworkError only sometimes comes before rank 0's data error),
so the order that misled the doctor is fixed here rather than waited for.
"""

from __future__ import annotations

from hpctrain.diagnose.doctor import diagnose_run, format_diagnosis

from ._runs import event, gpu_job, make_run

DATA = "train.data: /data/t.bin holds 0 tokens, fewer than seq_len + 1 = 4097; prepare more text or lower model.seq_len"


def test_a_run_that_refused_its_input_says_why_first(tmp_path):
    events = [event("submitted", 0.0, executor="local"), event("started", 1.0, attempt=0, hosts=["node1"]),
              event("failed", 5.0, attempt=0, rank=1, exit_code=1,
                    reason="DistNetworkError: Connection reset by peer"),
              event("failed", 5.1, attempt=0, rank=0, exit_code=2, reason=DATA),
              event("ended", 6.0, attempt=0, state="FAILED", reason="rank 1 exited with code 1", exit_codes=[2, 1])]
    run = make_run(tmp_path, gpu_job(), events=events)
    diagnosis = diagnose_run(run)
    first = diagnosis.findings[0]
    assert (first.family, first.severity, first.title) == ("failed", "error", f"the run refused its input: {DATA}")
    assert first.evidence[0] == "recorded by rank(s) 0 (attempt 0, exit code 2)"
    assert "rank 1: DistNetworkError: Connection reset by peer" in first.evidence
    assert "no problems found" not in format_diagnosis(diagnosis)


def test_a_finished_run_has_no_failed_finding(tmp_path):
    events = [event("started", 1.0, attempt=0, hosts=["node1"]),
              event("failed", 5.0, attempt=0, rank=0, exit_code=1, reason="RuntimeError: boom"),
              event("started", 10.0, attempt=1, hosts=["node1"]), event("finished", 60.0, attempt=1, step=100)]
    run = make_run(tmp_path, gpu_job(), events=events)
    assert not [f for f in diagnose_run(run).findings if f.family == "failed"]
