"""The doctor/report CLI and the login-path import rule. (The plan's three walls: tests/plan/test_cli.py.)"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from hpctrain.config import job_from_dict
from hpctrain.cli.diagnose import register
from hpctrain.plan.planner import plan_job

from ._runs import gpu_job, healthy_telemetry, make_run, metrics_lines


def _cli(*argv):
    parser = argparse.ArgumentParser(prog="hpctrain")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.handler(args)


def test_doctor_cli_exit_codes_and_json(tmp_path, capsys):
    metrics, ranks = healthy_telemetry()
    healthy = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks, name="ok")
    assert _cli("doctor", str(healthy), "--no-scheduler") == 0
    assert "no problems found" in capsys.readouterr().out
    sick = make_run(tmp_path, gpu_job(), metrics=metrics_lines(20, 2.2, comm_s=1.5, mfu=0.42), name="sick")
    assert _cli("doctor", str(sick), "--json", "--no-scheduler") == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["family"] for f in data["findings"]] == ["comm"]
    assert all(isinstance(fix["set"], list) for fix in data["findings"][0]["fixes"])


def test_report_cli_tables_only(tmp_path, capsys):
    metrics, ranks = healthy_telemetry()
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks)
    assert _cli("report", str(run), "--no-plots", "-o", str(tmp_path / "r")) == 0
    assert (tmp_path / "r" / "report.txt").read_text().startswith("run ")
    assert "wrote:" in capsys.readouterr().out


def test_login_path_imports_no_torch_and_no_matplotlib():
    code = ("import sys, hpctrain.cli.diagnose, hpctrain.diagnose.doctor, hpctrain.diagnose.report; "
            "print('torch' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_plan_json_and_the_planner_give_the_same_prediction():
    import pytest

    from hpctrain.diagnose.predict import from_layout, from_plan_json

    result = plan_job(job_from_dict(gpu_job(parallel={"tp": 1, "pp": 2, "dp": 4, "schedule": "1f1b",
                                                      "virtual_stages": 1})))
    direct = from_layout(result.best, result.budget_bytes)
    recorded = from_plan_json(json.loads(json.dumps(result.to_json(top=1))))
    assert recorded is not None
    for name in ("total_bytes", "budget_bytes", "step_time_s", "compute_s", "pp_comm_s", "bubble_s", "tokens_per_s",
                 "mfu", "comm_share", "bubble_share", "stage_imbalance"):
        assert getattr(recorded, name) == pytest.approx(getattr(direct, name), rel=2e-3, abs=1e-3 * 2**30), name
    assert recorded.stage_layers == direct.stage_layers and recorded.peak_rank == direct.peak_rank


def test_report_to_a_blocked_output_is_one_line(tmp_path, capsys):
    """Issue 18, finding 6: `report -o` under a file (or into a device) was a traceback."""
    from hpctrain.cli import main

    metrics, ranks = healthy_telemetry()
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks)
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile" / "r", tmp_path / "afile"):
        assert main(["report", str(run), "--no-plots", "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"-o '{out}': cannot write there" in err, err
