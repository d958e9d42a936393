"""The #SBATCH options and the resolved-job inputs of the script, table-driven."""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import RenderError
from hpctrain.render import render_script, resolve

from .hostile import BASE_JOB
from .sbatch_parser import option_values


def _job(**changes: Any) -> Any:
    data = copy.deepcopy(BASE_JOB)
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
    return job_from_dict(data)


def _options(job: Any, **kwargs: Any) -> dict[str, str | None]:
    return option_values(render_script(job, run_dir="/runs/x", **kwargs))


def test_the_options_a_careful_user_writes() -> None:
    job = _job(slurm__partition="gpu", slurm__account="proj-1", slurm__qos="high", slurm__cpus_per_task=12,
               slurm__constraint="a100&ib", slurm__time="2-00:00:00")
    assert _options(job) == {
        "--job-name": "x", "--nodes": "2", "--ntasks-per-node": "2", "--gpus-per-node": "2",
        "--cpus-per-task": "12", "--exclusive": None, "--mem": "0", "--time": "2-00:00:00",
        "--partition": "gpu", "--account": "proj-1", "--qos": "high", "--constraint": "a100&ib",
        "--signal": "USR2@120", "--requeue": None, "--open-mode": "append", "--output": "/runs/x/slurm-%j.out",
    }


@pytest.mark.parametrize(("changes", "expected"), [
    ({"slurm__exclusive": False}, {}),
    ({"slurm__exclusive": False, "slurm__mem": "500G"}, {"--mem": "500G"}),
    ({"slurm__exclusive": True, "slurm__mem": "64000M"}, {"--exclusive": None, "--mem": "64000M"}),
])
def test_memory_and_exclusivity(changes: dict[str, Any], expected: dict[str, Any]) -> None:
    options = _options(_job(**changes))
    assert {k: v for k, v in options.items() if k in ("--mem", "--exclusive")} == expected


def test_extra_options_and_gres_instead_of_gpus_per_node() -> None:
    job = _job(slurm__extra={"gres": "gpu:a100:2", "mail-type": "END,FAIL", "reservation": "maint window",
                             "hint": False, "overcommit": True, "nice": 10})
    options = _options(job)
    assert "--gpus-per-node" not in options and options["--gres"] == "gpu:a100:2"
    assert options["--mail-type"] == "END,FAIL" and options["--reservation"] == "maint window"
    assert options["--overcommit"] is None and options["--nice"] == "10" and "--hint" not in options


@pytest.mark.parametrize("key", ["output", "signal", "array", "job-name", "nodes", "requeue", "open-mode", "wrap"])
def test_extra_cannot_take_over_what_hpctrain_writes(key: str) -> None:
    with pytest.raises(RenderError, match=rf"slurm\.extra\.{key}: hpctrain writes --{key} itself .*; set it through"):
        _options(_job(slurm__extra={key: "x"}))


def test_cpu_jobs_ask_for_no_gpus() -> None:
    assert "--gpus-per-node" not in _options(_job(cluster__gpu="cpu"))


def test_switches_come_from_the_planner() -> None:
    job = resolve(_job())
    placed = job.model_copy(update={"placement": job.placement.model_copy(update={"switches": 1})})
    assert _options(placed)["--switches"] == "1"


@pytest.mark.parametrize("spec", ["0-7%4", "0,2,5", "1-9:2", "3"])
def test_array_specs(spec: str) -> None:
    assert _options(_job(), array=spec)["--array"] == spec


@pytest.mark.parametrize("spec", ["0-7%", "x", "0-3 --uid=0", "", "0-3\n"])
def test_bad_array_specs_are_refused(spec: str) -> None:
    with pytest.raises(RenderError, match="array: not an sbatch --array spec"):
        _options(_job(), array=spec)


def test_run_dir_with_backslash_is_refused() -> None:
    with pytest.raises(RenderError, match="run directory: a backslash turns off Slurm's %j"):
        render_script(_job(), run_dir="/runs/a\\b")


def test_percent_in_run_dir_is_escaped_for_slurm() -> None:
    assert option_values(render_script(_job(), run_dir="/runs/100%"))["--output"] == "/runs/100%%/slurm-%j.out"


def test_unresolved_layout_without_a_planner_names_the_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hpctrain.plan", None)  # import hpctrain.plan -> ImportError
    with pytest.raises(RenderError, match=r"parallel\.tp: is 'auto', but this hpctrain has no planner"):
        render_script(_job(parallel__tp="auto"), run_dir="/runs/x")
    explicit = _job()
    assert resolve(explicit) is explicit


def test_resolved_jobs_are_not_planned_again() -> None:
    resolved = resolve(_job())
    assert resolved.placement is not None
    assert resolve(resolved) is resolved


def test_rank_order_must_fit_the_cluster() -> None:
    resolved = resolve(_job())
    broken = resolved.model_copy(update={"placement": resolved.placement.model_copy(update={"rank_order": [1, 0]})})
    with pytest.raises(RenderError, match=r"placement\.rank_order: must be a permutation of 0\.\.3"):
        render_script(broken, run_dir="/runs/x")
