"""PNG plots of a run or a sweep (matplotlib, the `plot` extra, Agg backend: no display needed).

Imported only by `hpctrain report`; matplotlib itself is imported on the first plot, with a clear
message when the extra is not installed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.errors import ConfigError
from hpctrain.rundir.safe_files import write_atomic

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.diagnose.report import RunSummary, SweepRow

DPI = 110
MEASURED, PLANNED, RESTART, LAYOUT = "#1f77b4", "#ff7f0e", "#d62728", "#9467bd"
VALIDATION = "#2ca02c"


NO_MATPLOTLIB = ("report: no PNGs: pictures need matplotlib, the plot extra (pip install 'hpctrain[plot]'); "
                 "the tables are in report.txt")


def have_matplotlib() -> bool:
    """Whether the plot extra is installed (report then writes the tables alone, and says so)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or ConfigError (exit 2) saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("report: PNG plots need matplotlib, which is not installed; install the plot extra "
                          "(pip install 'hpctrain[plot]') or pass --no-plots for the tables only") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI)
    pyplot().close(fig)
    write_atomic(path, png.getvalue())  # the report folder is in the run directory: never through a link
    return path


def _mark_restarts(ax: Any, restarts: list[tuple[int, int]], label: bool) -> None:
    for i, (step, attempt) in enumerate(restarts):
        ax.axvline(step, color=RESTART, linestyle="--", linewidth=1,
                   label="restart (resumed from a checkpoint)" if label and i == 0 else None)
        if label:
            ax.annotate(f"attempt {attempt}", (step, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=7, color=RESTART)


def _mark_layout_changes(ax: Any, changes: list[tuple[int, int, str]], label: bool) -> None:
    for i, (step, attempt, change) in enumerate(changes):
        ax.axvline(step, color=LAYOUT, linestyle="-.", linewidth=1.5,
                   label="layout changed" if label and i == 0 else None)
        if label:
            ax.annotate(change, (step, 0.0), xycoords=("data", "axes fraction"), rotation=90, va="bottom",
                        ha="left", fontsize=6, color=LAYOUT)


def plot_training(summary: "RunSummary", path: Path) -> Path:
    """Loss and tokens/s over steps, restarts and layout changes marked, the planner's tokens/s as a line."""
    plt = pyplot()
    metrics = summary.run.metrics
    steps = [m["step"] for m in metrics]
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, [m.get("loss") for m in metrics], color=MEASURED, marker="." if len(steps) < 60 else None,
                 label="train")
    val = [(m["step"], m["val_loss"]) for m in metrics if isinstance(m.get("val_loss"), (int, float))]
    if val:  # train.eval_every: a point per evaluation
        ax_loss.plot([s for s, _ in val], [v for _, v in val], color=VALIDATION, marker="o", label="validation")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{summary.label}: loss and throughput")
    _mark_restarts(ax_loss, summary.restarts, label=True)
    _mark_layout_changes(ax_loss, summary.layout_changes, label=True)
    ax_tps.plot(steps, [m.get("tokens_per_s") for m in metrics], color=MEASURED, label="measured",
                marker="." if len(steps) < 60 else None)
    pred = summary.prediction
    reference = pred.tokens_per_s if pred is not None else None
    if reference and planned_on_cpu(summary):
        # The catalog's CPU entry is a placeholder, 20-450x off a real CPU: no line to hold the run to.
        ax_tps.plot([], [], " ", label=f"planner ({reference:,.0f}) not drawn: its cluster.gpu: cpu figure is unreliable")
        reference = None
    elif reference:
        ax_tps.axhline(reference, color=PLANNED, linestyle=":", label=f"planner ({reference:,.0f})")
    _mark_restarts(ax_tps, summary.restarts, label=False)
    _mark_layout_changes(ax_tps, summary.layout_changes, label=False)
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("step")
    throughput = [m.get("tokens_per_s") for m in metrics] + [reference]
    if _spans_decades(throughput):
        ax_tps.set_yscale("log")
    _human_axis(ax_tps.yaxis)
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    if not steps:
        ax_loss.text(0.5, 0.5, "no metrics logged yet", transform=ax_loss.transAxes, ha="center")
    return _save(fig, path)


def planned_on_cpu(summary: "RunSummary") -> bool:
    """The run was planned for cluster.gpu: cpu (job.resolved.yaml), whose planner figures are no reference."""
    cluster = (summary.run.job_data or {}).get("cluster")
    return isinstance(cluster, dict) and cluster.get("gpu") == "cpu"


def _spans_decades(values: list[Any]) -> bool:
    """Measured CPU throughput next to a GPU prediction: use a log axis when they differ 20x or more."""
    positive = [v for v in values if isinstance(v, (int, float)) and v > 0]
    return bool(positive) and max(positive) / min(positive) >= 20


def human(value: float) -> str:
    """1234567 -> 1.23M, 400000 -> 400k, 48.2 -> 48.2 (tick and bar labels)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _human_axis(axis: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: human(v)))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def plot_memory(rows: list[tuple[str, Optional[float], Optional[float]]], summary: "RunSummary", path: Path) -> Path:
    """Planned vs measured GiB per component (grouped bars), the memory budget as a line."""
    plt = pyplot()
    names = [name for name, _, _ in rows]
    planned = [p or 0.0 for _, p, _ in rows]
    measured = [m or 0.0 for _, _, m in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = list(range(len(names)))
    width = 0.38
    bars_p = ax.bar([i - width / 2 for i in x], planned, width, label="planned", color=PLANNED)
    bars_m = ax.bar([i + width / 2 for i in x], measured, width, label="measured", color=MEASURED)
    for bars, values in ((bars_p, [p for _, p, _ in rows]), (bars_m, [m for _, _, m in rows])):
        for bar, value in zip(bars, values):
            ax.annotate("n/a" if value is None else f"{value:.3g}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    pred = summary.prediction
    tallest_gib = max(planned + measured + [0.0])
    if pred is not None and pred.budget_bytes:
        budget_gib = pred.budget_bytes / 2**30
        if tallest_gib >= 0.1 * budget_gib:  # a far-away budget line would flatten every bar to nothing
            ax.axhline(budget_gib, color=RESTART, linestyle="--", linewidth=1, label=f"budget {budget_gib:.0f} GiB")
        else:
            ax.plot([], [], " ", label=f"budget {budget_gib:.0f} GiB (off scale: peak uses "
                                       f"{tallest_gib / budget_gib:.1%})")
    ax.set_xticks(x)
    ax.set_xticklabels(names)
    ax.set_ylabel("GiB per GPU (most loaded rank)")
    ax.set_title(f"{summary.label}: memory, planned vs measured")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_sweep(rows: list["SweepRow"], path: Path) -> Path:
    """Tokens/s and MFU (TFLOP/s per GPU when no MFU was measured) per configuration, ranked, with
    the planner's estimate beside each measurement."""
    plt = pyplot()
    labels = [f"#{i + 1} {r.point or f'task {r.task_id}'}" for i, r in enumerate(rows)]
    use_mfu = any(r.mfu is not None for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.7 * max(1, len(rows))))
    panels = [("tokens/s", [r.tokens_per_s for r in rows], [r.planned_tokens_per_s for r in rows])]
    if use_mfu:
        panels.append(("MFU (%)", [None if r.mfu is None else 100 * r.mfu for r in rows],
                       [None if r.planned_mfu is None else 100 * r.planned_mfu for r in rows]))
    else:
        panels.append(("TFLOP/s per GPU (no MFU on CPU)", [r.tflops_per_gpu for r in rows],
                       [r.planned_tflops_per_gpu for r in rows]))
    y = list(range(len(rows)))
    for ax, (title, measured, planned) in zip(axes, panels):
        h = 0.38
        ax.barh([i - h / 2 for i in y], [m or 0.0 for m in measured], h, color=MEASURED, label="measured")
        ax.barh([i + h / 2 for i in y], [p or 0.0 for p in planned], h, color=PLANNED, label="planner")
        for i, (m, p) in enumerate(zip(measured, planned)):
            ax.annotate("n/a" if m is None else human(m), (m or 0.0, i - h / 2), va="center", fontsize=7,
                        xytext=(2, 0), textcoords="offset points")
            ax.annotate("n/a" if p is None else human(p), (p or 0.0, i + h / 2), va="center", fontsize=7,
                        xytext=(2, 0), textcoords="offset points")
        if _spans_decades(measured + planned):
            ax.set_xscale("log")
        ax.set_xlim(right=ax.get_xlim()[1] * (1.5 if ax.get_xscale() == "log" else 1.12))  # room for labels
        _human_axis(ax.xaxis)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()  # best first, at the top
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="upper right", ncol=2, frameon=False)
    axes[1].set_yticklabels([])
    fig.suptitle(f"sweep: {len(rows)} configuration(s), ranked by measured tokens/s", fontsize=10)
    return _save(fig, path)
