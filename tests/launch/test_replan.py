"""Elastic node ranges without Slurm: the config forms, validate-time refusals, the rendered script,
and `python -m hpctrain.launch.replan` on a real run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpctrain.config import dump_job
from hpctrain.config.loader import job_from_dict
from hpctrain.errors import ConfigError
from hpctrain.launch.replan import main, replan
from hpctrain.rundir.events import LAYOUT_CHANGED

REPO = Path(__file__).resolve().parents[2]


def _job(**cluster: Any) -> dict[str, Any]:
    return {"name": "el", "model": {"preset": "tiny"},
            "train": {"global_batch": 12, "micro_batch": 1, "steps": 4, "precision": "fp32"},
            "parallel": {"tp": 1, "pp": 1},
            "cluster": {"executor": "slurm", "gpus_per_node": 1, "gpu": "a100-80gb", **cluster},
            "slurm": {"exclusive": False}}


@pytest.mark.parametrize("cluster", [{"nodes": "2-3"}, {"nodes": " 2 - 3 "}, {"min_nodes": 2, "max_nodes": 3}])
def test_range_forms(cluster: dict[str, Any]) -> None:
    c = job_from_dict(_job(**cluster)).cluster
    assert (c.nodes, c.min_nodes, c.max_nodes, c.elastic, c.nodes_spec) == (3, 2, 3, True, "2-3")
    assert c.node_counts == [2, 3]


def test_fixed_count_is_not_elastic() -> None:
    c = job_from_dict(_job(nodes=2)).cluster
    assert (c.elastic, c.nodes_spec, c.node_counts) == (False, "2", [2])


@pytest.mark.parametrize("cluster, parallel, train, message", [
    ({"nodes": "3-2"}, {}, {}, "cluster.nodes: the range's low end is above its high end"),
    ({"nodes": "two"}, {}, {}, "cluster.nodes: expected a whole number of nodes (1-100000) or a range such as '4-8'"),
    ({"nodes": 0}, {}, {}, "cluster.nodes: expected a whole number of nodes (1-100000) or a range such as '4-8'"),
    ({"min_nodes": 2}, {}, {}, "cluster.min_nodes: a node range needs both"),
    ({"nodes": 5, "min_nodes": 2, "max_nodes": 3}, {}, {}, "cluster.nodes: is outside cluster.min_nodes..max_nodes"),
    ({"nodes": "2-3"}, {"dp": 3}, {}, "cluster.nodes: a node range needs a layout that can change"),
    ({"nodes": "2-4", "gpus_per_node": 2}, {"tp": 2, "pp": 1}, {"global_batch": 6},
     "train.global_batch: must be divisible by micro_batch*dp at every node count of the range; it is not at 4"),
    ({"nodes": "1-3", "gpus_per_node": 1}, {"tp": 1, "pp": 2}, {"global_batch": 12},
     "cluster.nodes: the fixed degrees multiply to 2, which does not divide the GPUs of 1, 3 node(s)"),
])
def test_range_refusals(cluster: dict[str, Any], parallel: dict[str, Any], train: dict[str, Any],
                        message: str) -> None:
    job = _job(**cluster)
    job["parallel"].update(parallel)
    job["train"].update(train)
    with pytest.raises(ConfigError) as err:
        job_from_dict(job)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_validate_exits_2_with_one_line(tmp_path: Path) -> None:
    job = _job(nodes="2-3")
    job["parallel"]["dp"] = 3
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = subprocess.run([sys.executable, "-m", "hpctrain", "validate", str(path)], capture_output=True,
                            text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cluster.nodes: a node range needs a layout that can change" in lines[0], lines


def test_rendered_script_replans_and_asks_for_a_range() -> None:
    from hpctrain.plan import resolve_job
    from hpctrain.render import render_script

    resolved, _ = resolve_job(job_from_dict(_job(nodes="2-3")))
    script = render_script(resolved, array=None, run_dir="/runs/el")
    assert "#SBATCH --nodes=2-3\n" in script and "#SBATCH --mincpus=1\n" in script
    assert "--ntasks-per-node=1\n" not in script.split("set -uo")[0]  # not in the #SBATCH lines
    assert '-m hpctrain.launch.replan --run-dir="$TASK_DIR" --nodes="$NODES" --attempt="$ATTEMPT"' in script
    assert 'srun --kill-on-bad-exit=1 --nodes="$NODES"' in script
    fixed, _ = resolve_job(job_from_dict(_job(nodes=2)))
    plain = render_script(fixed, array=None, run_dir="/runs/el")
    assert "hpctrain.launch.replan" not in plain and "#SBATCH --ntasks-per-node=1\n" in plain


def _run_dir(tmp_path: Path) -> Path:
    from hpctrain.plan import resolve_job

    job = job_from_dict(_job(nodes="2-3"))
    resolved, _ = resolve_job(job)
    run = tmp_path / "run"
    (run / "submit").mkdir(parents=True)
    (run / "job.yaml").write_text(dump_job(job))
    (run / "job.resolved.yaml").write_text(dump_job(resolved))
    return run


def test_replan_rewrites_the_resolved_job_and_records_the_change(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    assert replan(run, 3, 0) is None  # started on the count planned at submit: nothing changes
    assert not (run / "events.jsonl").exists()
    event = replan(run, 2, 1)
    assert event is not None and event["event"] == LAYOUT_CHANGED
    assert event["old"] == {"nodes": 3, "tp": 1, "pp": 1, "dp": 3, "micro_batch": 1, "grad_accumulation": 4}
    assert event["new"] == {"nodes": 2, "tp": 1, "pp": 1, "dp": 2, "micro_batch": 1, "grad_accumulation": 6}
    resolved = yaml.safe_load((run / "job.resolved.yaml").read_text())
    assert resolved["cluster"]["nodes"] == 2 and resolved["parallel"]["dp"] == 2
    assert resolved["train"]["global_batch"] == 12  # the same global batch
    assert resolved["placement"] is not None  # placed again for the new node count
    assert (run / "submit" / "layouts" / "attempt-1.resolved.yaml").is_file()
    assert json.loads((run / "plan.json").read_text())
    assert replan(run, 2, 2) is None  # the same count again: no second event
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == [LAYOUT_CHANGED]


def test_replan_outside_the_range_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(tmp_path)
    assert main(["--run-dir", str(run), "--nodes", "5", "--attempt", "1"]) == 2
    err = capsys.readouterr().err
    assert "SLURM_JOB_NUM_NODES: the job got 5 node(s), outside cluster.nodes 2-3" in err
    assert main(["--run-dir", str(run), "--nodes", "two"]) == 2


def test_status_shows_every_layout(tmp_path: Path) -> None:
    from hpctrain.launch.status import format_table, run_status

    run = _run_dir(tmp_path)
    replan(run, 2, 1)
    status = run_status(run)
    assert [(lay["nodes"], lay["dp"]) for lay in status["layouts"]] == [(3, 3), (2, 2)]
    text = format_table(status)
    assert "layouts:\n  submitted: nodes=3 tp=1 pp=1 dp=3" in text
    assert "  attempt 1: nodes=2 tp=1 pp=1 dp=2 micro_batch=1 grad_accumulation=6" in text


def test_replan_imports_no_torch(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    code = ("import sys; from hpctrain.launch.replan import main; rc = main(['--run-dir', sys.argv[1], '--nodes', '2']);"
            " assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert "layout changed: nodes=3 tp=1 pp=1 dp=3" in result.stdout


def test_doctor_and_report_show_the_layout_change(tmp_path: Path) -> None:
    from hpctrain.diagnose.doctor import diagnose_run, format_diagnosis
    from hpctrain.diagnose.report import summarize, summary_rows

    run = _run_dir(tmp_path)
    replan(run, 2, 1)
    text = format_diagnosis(diagnose_run(run, scheduler_query=lambda *a, **k: {}))
    assert "note: layout changed at attempt 1: nodes=3 tp=1 pp=1 dp=3" in text and "-> nodes=2 tp=1" in text, text
    rows = {row[0]: row[1] for row in summary_rows(summarize(run))}
    assert rows["layout changed (attempt 1)"].startswith("nodes=3 tp=1 pp=1 dp=3"), rows
    assert rows["layout"].startswith("1x1x2"), rows
