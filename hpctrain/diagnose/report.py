"""`hpctrain report`: tables (tabulate) of a run or a sweep, measured beside the planner's estimate.

The data is gathered here once (`RunSummary`, `SweepRow`) and handed to the tables and to the
plots (plots.py, matplotlib), so both show the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tabulate import tabulate

from hpctrain.diagnose.context import measured_share, rank_coords, timed_ranks
from hpctrain.diagnose.findings import GIB
from hpctrain.diagnose.predict import COMPONENTS, Prediction, predict_run
from hpctrain.diagnose.rules_memory import measured_peak, state_bytes
from hpctrain.diagnose.rundata import RunData, load_run
from hpctrain.rundir.events import LAYOUT_CHANGED, STARTED
from hpctrain.rundir.layouts import describe
from hpctrain.rundir.safe_files import write_atomic
from hpctrain.rundir.terminal import printable

MEMORY_ROWS = ("weights", "grads", "optimizer", "activations + other", "total")


@dataclass
class RunSummary:
    run: RunData
    prediction: Optional[Prediction]
    prediction_problem: str
    restarts: list[tuple[int, int]] = field(default_factory=list)  # (first step of the attempt, attempt)
    # (first step of the attempt, attempt, "old -> new"): an attempt that ran another layout than the one before
    layout_changes: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.run.path.name


def summarize(path: str | Path) -> RunSummary:
    run = load_run(path)
    prediction, problem = predict_run(run.job_data, run.plan)
    restarts = []
    previous = None
    for record in run.metrics:
        attempt = int(record.get("attempt") or 0)
        if previous is not None and attempt != previous:
            restarts.append((int(record["step"]), attempt))
        previous = attempt
    changed = attempt_layout_changes(run)
    layout_changes = [(step, attempt, changed[attempt]) for step, attempt in restarts if attempt in changed]
    return RunSummary(run, prediction, problem, restarts, layout_changes)


def attempt_layout_changes(run: RunData) -> dict[int, str]:
    """attempt -> "old -> new" for each attempt that ran another layout than the attempt before it: from
    the runtime's `started` events (each records its layout) and an elastic start's `layout_changed`."""
    out: dict[int, str] = {}
    for change in run.events_named(LAYOUT_CHANGED):
        if isinstance(change.get("attempt"), int):
            out[change["attempt"]] = f"{describe(change.get('old') or {})} -> {describe(change.get('new') or {})}"
    before: Optional[dict[str, Any]] = None
    for start in run.events_named(STARTED):
        layout, attempt = start.get("layout"), start.get("attempt")
        if not isinstance(layout, dict) or not isinstance(attempt, int):
            continue
        if before is not None and layout != before and attempt not in out:
            out[attempt] = f"{describe(before)} -> {describe(layout)}"
        before = layout
    return out


def _fmt(value: Optional[float], spec: str = ",.1f", scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def summary_rows(s: RunSummary) -> list[list[str]]:
    run, pred = s.run, s.prediction
    losses = [m["loss"] for m in run.metrics if isinstance(m.get("loss"), (int, float))]
    val_losses = [m["val_loss"] for m in run.metrics if isinstance(m.get("val_loss"), (int, float))]
    comm, bubble = measured_share(run, "time_comm_exposed_s"), measured_share(run, "time_bubble_s")
    pred_bubble = pred.share((pred.bubble_s or 0.0) + (pred.pp_comm_s or 0.0)) if pred else None
    rows = [
        ["layout", str(run.layout.get("tp")) + "x" + str(run.layout.get("pp")) + "x" + str(run.layout.get("dp"))
         + " (tp x pp x dp)", pred.label if pred else s.prediction_problem or "-"],
        ["steps logged", f"{len(run.metrics)} (last {run.metrics[-1]['step']})" if run.metrics else "0", ""],
        ["restarts", str(len(s.restarts)), ""],
        ["final loss", _fmt(losses[-1] if losses else None, ".4f"), ""],
        ["final validation loss", _fmt(val_losses[-1] if val_losses else None, ".4f"), ""],
        ["step time (s, median)", _fmt(run.median_metric("step_time_s"), ".4f"),
         _fmt(pred.step_time_s if pred else None, ".4f")],
        ["tokens/s (median)", _fmt(run.median_metric("tokens_per_s"), ",.0f"),
         _fmt(pred.tokens_per_s if pred else None, ",.0f")],
        ["TFLOP/s per GPU", _fmt(run.median_metric("tflops_per_gpu"), ".3g"),
         _fmt(pred.tflops_per_gpu if pred else None, ".3g")],
        ["MFU", _fmt(run.median_metric("mfu"), ".1f", 100, " %"), _fmt(pred.mfu if pred else None, ".1f", 100, " %")],
        ["exposed comm share", _fmt(comm[0] if comm else None, ".1f", 100, " %"),
         _fmt(pred.comm_share if pred else None, ".1f", 100, " %")],
        ["pipeline wait share", _fmt(bubble[0] if bubble else None, ".1f", 100, " %"),
         _fmt(pred_bubble, ".1f", 100, " %")],
    ]
    for attempt, change in sorted(attempt_layout_changes(run).items(), reverse=True):  # one row per new layout
        rows.insert(1, [f"layout changed (attempt {attempt})", change, ""])
    return rows


def memory_table(s: RunSummary) -> list[tuple[str, Optional[float], Optional[float]]]:
    """(component, planned GiB, measured GiB) for weights, grads, optimizer, activations + other, total.

    Measured: the rank with the largest peak; its parameter/gradient/optimizer bytes as counted by
    the runtime, activations + other = peak minus those.
    """
    pred = s.prediction
    planned: dict[str, Optional[float]] = {name: None for name in MEMORY_ROWS}
    if pred is not None:
        mem = pred.memory_bytes
        for name in ("weights", "grads", "optimizer"):
            planned[name] = mem.get(name, 0.0) / GIB
        planned["activations + other"] = (mem.get("activations", 0.0) + mem.get("other", 0.0)) / GIB
        planned["total"] = pred.total_bytes / GIB
    measured: dict[str, Optional[float]] = {name: None for name in MEMORY_ROWS}
    peak = measured_peak_rank(s.run)
    if peak is not None:
        states = state_bytes(peak)
        for name, value in states.items():
            measured[name] = value / GIB
        total = float(peak["peak_memory_bytes"])
        measured["total"] = total / GIB
        if states:
            measured["activations + other"] = max(0.0, total - sum(states.values())) / GIB
    else:
        any_peak = measured_peak_value(s.run)
        measured["total"] = any_peak / GIB if any_peak is not None else None
    return [(name, planned[name], measured[name]) for name in MEMORY_ROWS]


def measured_peak_rank(run: RunData) -> Optional[dict[str, Any]]:
    ranks = [r for r in run.ranks if isinstance(r.get("peak_memory_bytes"), (int, float))]
    return max(ranks, key=lambda r: r["peak_memory_bytes"]) if ranks else None


def measured_peak_value(run: RunData) -> Optional[float]:
    peak = measured_peak(run)
    return peak[0] if peak else None


def rank_rows(run: RunData) -> list[list[Any]]:
    rows = []
    for r in timed_ranks(run) or run.ranks:
        c = rank_coords(r, run.layout)
        rows.append([r["rank"], r.get("host", "?"), f"{c['pp']}/{c['dp']}/{c['tp']}", _fmt(r.get("step_time_s"), ".4f"),
                     _fmt(r.get("time_compute_s"), ".4f"), _fmt(r.get("time_comm_exposed_s"), ".4f"),
                     _fmt(r.get("time_bubble_s"), ".4f"), _fmt(r.get("peak_memory_bytes"), ".2f", 1 / GIB)])
    return rows


def run_tables(s: RunSummary) -> str:
    parts = [f"run {s.run.path}",
             tabulate(summary_rows(s), headers=["", "measured", "planner"], tablefmt="simple", disable_numparse=True),
             "memory per GPU, GiB (measured: the rank with the largest peak)",
             tabulate([[n, _fmt(p, ".3f"), _fmt(m, ".3f")] for n, p, m in memory_table(s)],
                      headers=["component", "planned", "measured"], tablefmt="simple", disable_numparse=True)]
    ranks = rank_rows(s.run)
    if ranks:
        parts += ["per rank (means per step, warm-up excluded)",
                  tabulate(ranks, headers=["rank", "host", "pp/dp/tp", "step s", "compute s", "comm s", "bubble s",
                                           "peak GiB"], tablefmt="simple", disable_numparse=True)]
    return "\n\n".join(parts)


@dataclass
class SweepRow:
    task_id: int
    point: str
    run_dir: Path
    state: str
    tokens_per_s: Optional[float]
    planned_tokens_per_s: Optional[float]
    mfu: Optional[float]
    planned_mfu: Optional[float]
    tflops_per_gpu: Optional[float]
    planned_tflops_per_gpu: Optional[float]


def sweep_rows(sweep_dir: Path) -> list[SweepRow]:
    """One row per task of sweep.json, ranked by measured tokens/s (unmeasured last)."""
    from hpctrain.diagnose.doctor import run_state

    from hpctrain.rundir.sweep_file import read_sweep

    data = read_sweep(sweep_dir)
    rows = []
    for task in data.get("tasks", []):
        run = load_run(sweep_dir / task["run_dir"])
        pred, _ = predict_run(run.job_data, run.plan)
        point = " ".join(f"{k}={v}" for k, v in (task.get("point") or {}).items())
        rows.append(SweepRow(int(task["task_id"]), point, run.path, run_state(run), run.median_metric("tokens_per_s"),
                             pred.tokens_per_s if pred else None, run.median_metric("mfu"), pred.mfu if pred else None,
                             run.median_metric("tflops_per_gpu"), pred.tflops_per_gpu if pred else None))
    rows.sort(key=lambda r: (r.tokens_per_s is None, -(r.tokens_per_s or 0.0)))
    return rows


def sweep_table(rows: list[SweepRow]) -> str:
    table = [[i + 1, r.task_id, r.point, r.state, _fmt(r.tokens_per_s, ",.0f"), _fmt(r.planned_tokens_per_s, ",.0f"),
              _fmt(r.mfu, ".1f", 100, " %"), _fmt(r.planned_mfu, ".1f", 100, " %"), _fmt(r.tflops_per_gpu, ".3g"),
              _fmt(r.planned_tflops_per_gpu, ".3g")] for i, r in enumerate(rows)]
    return tabulate(table, headers=["#", "task", "configuration", "state", "tokens/s", "planned", "MFU", "planned",
                                    "TFLOP/s/GPU", "planned"], tablefmt="simple", disable_numparse=True)


def write_report(target: str | Path, out_dir: Optional[str | Path] = None,
                 plots: bool = True) -> tuple[str, list[Path]]:
    """Tables (also written to report.txt) and PNGs of a run or a sweep. Returns (text, files)."""
    from hpctrain.rundir.layout import is_sweep
    from hpctrain.userfiles import writing_output

    root = Path(target)
    out = Path(out_dir) if out_dir else root / "report"
    files: list[Path] = []
    # Read first, then write: an OSError inside the writing block is about the output folder only.
    if is_sweep(root):
        rows = sweep_rows(root)
        text = f"sweep {root}: {len(rows)} configuration(s), ranked by measured tokens/s\n\n" + sweep_table(rows)
    else:
        summary = summarize(root)
        text = run_tables(summary)
    text = printable(text)  # host names, paths and reasons come from the run directory (rundir/terminal.py)
    with writing_output("-o" if out_dir else "report folder", out):
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "report.txt", text + "\n")
        if plots:
            from hpctrain.diagnose import plots as plotting

            if is_sweep(root):
                files.append(plotting.plot_sweep(rows, out / "sweep.png"))
            else:
                files += [plotting.plot_training(summary, out / "training.png"),
                          plotting.plot_memory(memory_table(summary), summary, out / "memory.png")]
    return text, [out / "report.txt", *files]


__all__ = ["COMPONENTS", "RunSummary", "SweepRow", "memory_table", "summarize", "sweep_rows", "write_report"]
