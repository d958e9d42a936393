"""The validation loss in the doctor (a diverging or non-finite val_loss), the report and `status`."""

from __future__ import annotations

import json

from hpctrain.diagnose.doctor import diagnose_run
from hpctrain.diagnose.report import write_report
from hpctrain.launch.status import format_table
from hpctrain.rundir.metrics import last_value

from ._runs import assert_fixes_replan, gpu_job, make_run, metrics_lines


def _with_val(val: dict[int, float], train_rising: bool = False) -> list[dict]:
    lines = metrics_lines(50, 2.2)
    for line in lines:
        if train_rising and line["step"] > 20:
            line["loss"] = 5.0 + 0.1 * (line["step"] - 20)  # 10/(1+0.05*20) = 5.0 at step 20, then up
        if line["step"] in val:
            line["val_loss"] = val[line["step"]]
    return lines


def _validation(run):
    return [f for f in diagnose_run(run).findings if f.family == "validation"]


def test_falling_validation_loss_is_fine(tmp_path) -> None:
    run = make_run(tmp_path, gpu_job(), metrics=_with_val({10: 3.0, 20: 2.6, 30: 2.5, 40: 2.45, 50: 2.44}))
    assert _validation(run) == []


def test_noise_below_the_threshold_is_fine(tmp_path) -> None:
    run = make_run(tmp_path, gpu_job(), metrics=_with_val({10: 3.0, 20: 2.5, 30: 2.51, 40: 2.52, 50: 2.53}))
    assert _validation(run) == []


def test_overfitting_keeps_the_best_step(tmp_path) -> None:
    run = make_run(tmp_path, gpu_job(), metrics=_with_val({10: 3.0, 20: 2.5, 30: 2.4, 40: 2.6, 50: 2.9}))
    (finding,) = _validation(run)
    assert finding.severity == "warning" and finding.title == "validation loss diverging since step 30"
    assert "2.9000 at step 50, 21 % above its best 2.4000 at step 30" in finding.evidence[0]
    assert "overfits" in finding.evidence[1]
    assert "step 30" in finding.fixes[0].why


def test_diverging_training_suggests_a_lower_learning_rate(tmp_path) -> None:
    run = make_run(tmp_path, gpu_job(), metrics=_with_val({10: 3.0, 20: 2.5, 30: 2.8, 40: 3.5, 50: 4.4},
                                                             train_rising=True))
    (finding,) = _validation(run)
    assert "diverges" in finding.evidence[1]
    assert finding.fixes[0].sets == ("train.optimizer.lr=0.00015",)
    assert_fixes_replan(run, finding)


def test_non_finite_validation_loss_is_an_error(tmp_path) -> None:
    run = make_run(tmp_path, gpu_job(), metrics=_with_val({10: 3.0, 20: float("nan")}))
    (finding,) = _validation(run)
    assert finding.severity == "error" and finding.title == "validation loss is nan at step 20"


def test_report_and_status_show_the_validation_loss(tmp_path) -> None:
    run = make_run(tmp_path, gpu_job(), metrics=_with_val({10: 3.0, 20: 2.6, 30: 2.5}))
    text, files = write_report(run, tmp_path / "out")
    (row,) = [line for line in text.splitlines() if "final validation loss" in line]
    assert "2.5000" in row
    assert [f.name for f in files][:2] == ["report.txt", "training.png"]
    assert last_value(run, "val_loss") == (30, 2.5)
    status = {"kind": "job", "name": "r", "run_dir": str(run), "state": "COMPLETED", "step": 50, "steps": 50,
              "tokens_per_s": 100.0, "loss": 1.5, "val_loss": 2.5, "restarts": 0}
    table = format_table(status)
    header, row = table.splitlines()[1], table.splitlines()[-1]
    assert header.split()[-2:] == ["val", "loss"] and row.split()[-1] == "2.5"


def test_last_value_reads_past_the_tail_block(tmp_path) -> None:
    lines = [{"step": 1, "loss": 1.0, "val_loss": 4.0}] + [{"step": s, "loss": 1.0, "pad": "x" * 200}
                                                         for s in range(2, 1000)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert last_value(tmp_path, "val_loss") == (1, 4.0)
    assert last_value(tmp_path, "val_loss", max_bytes=65536) is None
    assert last_value(tmp_path / "missing", "val_loss") is None
