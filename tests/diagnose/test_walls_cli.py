"""`explain_walls` (the plan's three walls), the doctor/report CLI, and the login-path import rule."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from hpctrain.config import job_from_dict, load_job
from hpctrain.diagnose.commands import register
from hpctrain.diagnose.walls import explain_walls
from hpctrain.plan.planner import plan_job

from ._runs import gpu_job, healthy_telemetry, make_run, metrics_lines


def test_walls_for_gpt3_on_1024_gpus():
    job = load_job("examples/gpt3-175b.yaml")
    result = plan_job(job)
    lines = explain_walls(job, result.best, result.budget_bytes)
    assert [line.split(":")[0] for line in lines] == ["memory wall", "compute wall", "communication wall"]
    assert "GiB per GPU" in lines[0] and "dominate" in lines[0]
    assert "TFLOP per GPU per step" in lines[1] and "MFU" in lines[1]
    assert "% of the step is exposed communication" in lines[2]


def test_walls_from_a_plan_json_layout():
    layout = {"tp": 2, "pp": 2, "dp": 2, "micro_batch": 1, "ac": "full", "zero": 1,
              "memory_gib": {"weights": 4.0, "grads": 2.0, "optimizer": 16.0, "activations": 10.0, "other": 2.0,
                             "total": 34.0},
              "step_time_s": 2.0, "compute_s": 1.4, "tp_comm_s": 0.2, "pp_comm_s": 0.05, "dp_comm_exposed_s": 0.05,
              "bubble_s": 0.3, "tokens_per_s": 1000.0, "tflops_per_gpu": 120.0, "mfu": 0.38, "comm_share": 0.15}
    job = job_from_dict(gpu_job(parallel={"tp": 2, "pp": 2, "dp": 2, "schedule": "1f1b", "virtual_stages": 1}))
    memory, compute, comm = explain_walls(job, layout, budget_bytes=80 * 2**30)
    assert memory.startswith("memory wall: 34.0 of 80.0 GiB per GPU (42 %); optimizer states dominate (16.0 GiB, 47 %")
    assert "zero 1+ shards them" in memory
    assert "compute is 70 % of the 2.000 s step" in compute and "recompute full" in compute
    assert comm == ("communication wall: 15 % of the step is exposed communication — TP 10 % (tp=2), PP 2 % (pp=2), "
                    "DP 2 % (dp=2 zero 1), bubble 15 %; bubble is the largest")


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
    code = ("import sys, hpctrain.diagnose.commands, hpctrain.diagnose.doctor, hpctrain.diagnose.report, "
            "hpctrain.diagnose.walls; print('torch' in sys.modules, 'matplotlib' in sys.modules)")
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
