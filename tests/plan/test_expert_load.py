"""`hpctrain plan --expert-load RUN_DIR` (issue 26 item 2: the load imbalance measured from the runtime's expert-load
metric where a run exists, a stated default otherwise). The runs here are metrics.jsonl files written as the runtime
writes them (tests/runtime/test_hf_moe.py plans from a real run's). Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli import main as cli_main
from hpctrain.config import job_from_dict
from hpctrain.errors import ConfigError
from hpctrain.plan import plan_job
from hpctrain.plan.kernels import DEFAULT_EXPERT_STEP_IMBALANCE
from hpctrain.plan.expert_load import KEY, RECENT_LINES, read_expert_load
from hpctrain.plan.hardware import resolve_hardware
from hpctrain.plan.planner import planned_precision
from hpctrain.plan.search import SearchSettings, optimizer_kind, search
from hpctrain.plan.space import Choices
from hpctrain.rundir.metrics import METRICS_FILE, records_backwards

SPEC = {"name": "mixtral-plan", "model": {"preset": "mixtral-8x7b", "seq_len": 2048},
        "train": {"global_batch": 256, "micro_batch": 1, "activation_checkpointing": "selective"},
        "parallel": {"tp": 1, "pp": 2, "dp": 8, "ep": 8, "zero": 1, "schedule": "1f1b"},
        "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}}


def write_run(path: Path, lines: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return path


def measured(run: Path, spec: dict = SPEC):
    """What `hpctrain plan --expert-load RUN` reads (cli/plan.py)."""
    return read_expert_load(str(run), job_from_dict(spec), run / METRICS_FILE, records_backwards(run, KEY))


def loads(step: int, ep2: float, ep4: float, ep8: float) -> dict:
    return {"step": step, "loss": 2.0, "expert_load_max_over_mean": ep8 + 0.1, "expert_load_ep2": ep2,
            "expert_load_ep4": ep4, "expert_load_ep8": ep8}


def test_the_newest_lines_are_averaged_per_ep(tmp_path):
    # an early router (x3.0 at ep 8) left behind: only the newest RECENT_LINES lines count; lines without the
    # figures (an evaluation line) and a torn last line are skipped
    old = [loads(s, 2.0, 2.5, 3.0) for s in range(1, 21)]
    new = [loads(s, 1.1 + (s % 2) * 0.1, 1.3, 1.5) for s in range(21, 21 + RECENT_LINES)]
    run = write_run(tmp_path / "run", old + new + [{"step": 71, "val_loss": 2.1}])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 72, "expert_load_ep2": 1.')
    got = measured(run)
    assert got.lines == RECENT_LINES and (got.first_step, got.last_step) == (21, 70)
    assert dict(got.by_ep) == pytest.approx({2: 1.15, 4: 1.3, 8: 1.5})
    assert "steps 21-70" in got.note() and "ep 8 x1.50" in got.note()


def test_the_search_prices_each_ep_with_its_own_figure(tmp_path):
    job = job_from_dict(SPEC)
    hw = resolve_hardware(job, None)

    def best(**extra):
        settings = SearchSettings(global_batch=256, precision=planned_precision(job), optimizer=optimizer_kind(job),
                                  budget_bytes=1e15, overhead_bytes=0.0, **extra)  # cost, not fit
        layouts, _, _ = search(job.model, hw, Choices.from_job(job), settings)
        return layouts[0]

    skewed = best(expert_load_by_ep=((2, 1.2), (4, 1.4), (8, 2.2)))
    flat = best(expert_load_imbalance=2.2)  # the step priced as the measured ep 8 figure, memory at the default
    default = best()
    assert skewed.ep == 8
    assert skewed.cost.step_time_s == pytest.approx(flat.cost.step_time_s, rel=1e-12)
    assert skewed.cost.step_time_s > default.cost.step_time_s
    assert skewed.memory.activations > flat.memory.activations == default.memory.activations
    balanced = best(expert_load_by_ep=((8, 1.0),))
    assert balanced.cost.step_time_s < default.cost.step_time_s  # below the default's x1.1


def test_plan_says_where_its_expert_load_came_from(tmp_path, capsys):
    run = write_run(tmp_path / "run", [loads(s, 1.1, 1.2, 1.4) for s in range(1, 5)])
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(SPEC))
    assert cli_main(["plan", str(job), "--expert-load", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"expert load measured in {run} (steps 1-4, 4 metrics lines)" in out
    assert "ep 2 x1.10, ep 4 x1.20, ep 8 x1.40" in out
    assert "activations of the busiest ep rank at the run's measured load" in out
    assert cli_main(["plan", str(job), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["expert_load"] == {"source": "default", "step_imbalance": DEFAULT_EXPERT_STEP_IMBALANCE}
    assert any("expert load not measured" in note and f"x{DEFAULT_EXPERT_STEP_IMBALANCE:.2f}" in note
               for note in plan["notes"])
    dense = tmp_path / "dense.yaml"
    dense.write_text(json.dumps({**SPEC, "model": {"preset": "llama3-8b", "seq_len": 4096},
                                 "parallel": {"tp": 1, "pp": 2, "dp": 8, "zero": 1}}))
    assert cli_main(["plan", str(dense), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_load"] is None  # a dense plan says nothing about experts


@pytest.mark.parametrize("case, message", [
    ("missing", "no such run directory"),
    ("no-metrics", "the run has no metrics.jsonl yet"),
    ("dense-run", "metrics.jsonl has no expert_load_ep<N> figures"),
    ("other-model", "the run routed over 16 experts, the job's model.moe.experts is 8"),
    ("dense-job", "the job's model has no model.moe"),
])
def test_a_run_that_cannot_price_the_job_is_a_one_line_error(tmp_path, capsys, case, message):
    run = tmp_path / "run"
    if case == "no-metrics":
        run.mkdir()
    elif case == "dense-run":
        write_run(run, [{"step": 1, "loss": 2.0}])
    elif case in ("other-model", "dense-job"):
        write_run(run, [{"step": 1, "expert_load_ep2": 1.0, "expert_load_ep4": 1.1, "expert_load_ep8": 1.2,
                         "expert_load_ep16": 1.3}] if case == "other-model" else [loads(1, 1.0, 1.1, 1.2)])
    spec = SPEC if case != "dense-job" else {**SPEC, "model": {"preset": "llama3-8b", "seq_len": 4096},
                                              "parallel": {"tp": 1, "pp": 2, "dp": 8, "zero": 1}}
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(spec))
    assert cli_main(["plan", str(job), "--expert-load", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"--expert-load {run}: ") and message in err and "\n" not in err
    with pytest.raises(ConfigError):
        plan_job(job_from_dict(spec), measured(run, spec))
