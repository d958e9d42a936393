"""`hpctrain report`: tables and PNGs of a run (restarts marked) and of a sweep; the PNGs are opened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.diagnose.report import memory_table, summarize, write_report

from ._runs import GIB, gpu_job, make_run, metrics_lines, rank_summary

matplotlib = pytest.importorskip("matplotlib")
import matplotlib.axes  # noqa: E402 - after the skip: the spies below wrap its drawing calls


def _open_png(path):
    import matplotlib.image as mpimg

    pixels = mpimg.imread(path)
    height, width = pixels.shape[:2]
    assert path.stat().st_size > 5000
    assert width >= 600 and height >= 300
    assert float(pixels.std()) > 0.05  # not a blank canvas
    return width, height


def _restarted_run(tmp_path):
    metrics = metrics_lines(20, 2.2, mfu=0.42, tflops=135.0) + metrics_lines(40, 2.3, mfu=0.40, tflops=130.0,
                                                                               attempt=1, first_step=21)
    ranks = [rank_summary(r, step_time_s=2.3, comm_s=0.1, peak_bytes=(18 + r % 2) * GIB, attempt=1) for r in range(8)]
    return make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks)


def test_run_report_tables_and_pngs(tmp_path):
    run = _restarted_run(tmp_path)
    summary = summarize(run)
    assert summary.restarts == [(21, 1)]
    rows = {name: (planned, measured) for name, planned, measured in memory_table(summary)}
    assert rows["weights"][1] == pytest.approx(2.0) and rows["optimizer"][1] == pytest.approx(2.0)
    assert rows["total"][1] == pytest.approx(19.0)
    assert rows["activations + other"][1] == pytest.approx(19.0 - 5.0)
    assert rows["total"][0] > 0
    text, files = write_report(run, tmp_path / "out")
    assert "tokens/s" in text and "memory per GPU" in text and "pp/dp/tp" in text
    assert [f.name for f in files] == ["report.txt", "training.png", "memory.png"]
    for png in files[1:]:
        _open_png(png)


def test_sweep_report_ranks_configurations_beside_the_plan(tmp_path):
    sweep = tmp_path / "sweep"
    points = [{"parallel.tp": tp, "train.micro_batch": mb} for tp in (1, 2) for mb in (1, 2)]
    tasks = []
    for i, point in enumerate(points):
        job = gpu_job(parallel={"tp": point["parallel.tp"], "dp": 8 // point["parallel.tp"]},
                      train={"micro_batch": point["train.micro_batch"]})
        tokens_s = 1000.0 * (i + 1)
        make_run(sweep / "tasks", job, name=str(i),
                 metrics=metrics_lines(10, 64 * 4096 / tokens_s, mfu=0.1 * (i + 1), tflops=30.0 * (i + 1)))
        tasks.append({"task_id": i, "point": point, "run_dir": f"tasks/{i}"})
    (sweep / "sweep.json").write_text(json.dumps({"name": "s", "grid": {}, "tasks": tasks, "skipped": []}))
    text, files = write_report(sweep)
    lines = text.splitlines()
    ranked = [line for line in lines if line.strip()[:1].isdigit()]
    assert [line.split()[1] for line in ranked] == ["3", "2", "1", "0"]  # task ids, fastest first
    assert files[-1].name == "sweep.png" and files[-1].parent == sweep / "report"
    _open_png(files[-1])


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_report_on_a_real_four_point_sweep(tmp_path):
    """`hpctrain sweep` through the launch stage's local executor (4 one-rank tasks), then the report."""
    from hpctrain.config import job_from_dict
    from hpctrain.launch.sweep import submit_sweep

    from ._real import cpu_job

    job = job_from_dict({**cpu_job(parallel={"dp": 1}, cluster={"gpus_per_node": 1}, train={"steps": 5}),
                         "runs_dir": str(tmp_path / "runs")})
    submission, sweep = submit_sweep(job, ["train.micro_batch=1,2", "train.activation_checkpointing=none,full"],
                                     max_parallel=2)
    assert submission.process is not None and submission.process.wait(timeout=240) == 0
    text, files = write_report(submission.run_dir)
    ranked = [line for line in text.splitlines() if line[:1].isdigit()]
    assert len(ranked) == 4 and all(" finished " in line for line in ranked)
    measured = [float(line.split("finished")[1].split()[0].replace(",", "")) for line in ranked]
    assert measured == sorted(measured, reverse=True)
    _open_png(files[-1])


def test_a_cpu_planned_run_gets_no_planner_line(tmp_path, monkeypatch):
    # Issue 29: the report drew the planner's CPU figure, 20-450x off, as the run's reference line.
    job = gpu_job(cluster={"gpu": "cpu", "node": None, "fabric": "ethernet"})
    run = make_run(tmp_path, job, metrics=metrics_lines(10, 0.05, tokens_per_step=512))
    lines, labels = [], []
    real_axhline, real_legend = matplotlib.axes.Axes.axhline, matplotlib.axes.Axes.legend

    def axhline(self, y=0, *args, **kwargs):  # a spy: the real call draws, the list keeps what was drawn
        lines.append(kwargs.get("label"))
        return real_axhline(self, y, *args, **kwargs)

    def legend(self, *args, **kwargs):
        labels.extend(self.get_legend_handles_labels()[1])
        return real_legend(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", axhline)
    monkeypatch.setattr(matplotlib.axes.Axes, "legend", legend)
    write_report(run, tmp_path / "cpu")
    assert not [label for label in lines if label and label.startswith("planner")]
    assert any("not drawn: its cluster.gpu: cpu figure is unreliable" in label for label in labels), labels

    lines.clear()
    write_report(make_run(tmp_path, gpu_job(), metrics=metrics_lines(10, 2.2), name="gpu"), tmp_path / "gpu")
    assert [label for label in lines if label and label.startswith("planner (")]  # a GPU plan keeps its line


def test_report_without_matplotlib_writes_the_tables_and_exits_0(tmp_path):
    # Issue 29: without the plot extra, report wrote report.txt and then exited 2 as for bad input.
    run = make_run(tmp_path, gpu_job(), metrics=metrics_lines(10, 2.2))
    code = ("import sys; sys.modules['matplotlib'] = None; from hpctrain.cli import main; "
            f"sys.exit(main(['report', {str(run)!r}]))")
    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "report: no PNGs: pictures need matplotlib, the plot extra (pip install 'hpctrain[plot]'); "
        "the tables are in report.txt"]
    assert (run / "report" / "report.txt").read_text().startswith(f"run {run}")
    assert not list((run / "report").glob("*.png"))
