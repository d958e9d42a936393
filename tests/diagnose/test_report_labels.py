"""The throughput `report` and `status` print says which it is (issue 29: `status` showed the last step's
tokens/s, `report` the median over steps, both labelled only "tokens/s")."""

from __future__ import annotations

from hpctrain.diagnose.report import summarize, summary_rows
from hpctrain.launch.status import format_table

from ._runs import gpu_job, make_run, metrics_lines


def test_report_labels_the_median_and_status_the_last_step(tmp_path) -> None:
    run = make_run(tmp_path, gpu_job(), metrics=metrics_lines(10, 2.0, mfu=0.4, tflops=120.0))
    labels = [row[0] for row in summary_rows(summarize(run))]
    assert "tokens/s (median)" in labels and "step time (s, median)" in labels
    status = {"kind": "job", "name": "r", "run_dir": str(run), "executor": "local", "state": "COMPLETED",
              "step": 10, "steps": 10, "tokens_per_s": 1234.0, "loss": 2.0, "restarts": 0}
    assert format_table(status).splitlines()[1].split() == ["task", "job", "id", "state", "restarts", "step",
                                                           "tokens/s", "(last)", "loss"]
