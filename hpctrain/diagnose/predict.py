"""The planner's prediction for a run, in one flat shape the rules compare measurements with.

Two sources, the same fields: re-planning the run's resolved job (every dimension pinned, so the
planner evaluates exactly the layout that ran: `predict_job`) or, when that is not possible, the
layout recorded in the run's plan.json (`from_plan_json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.diagnose.findings import GIB

if TYPE_CHECKING:
    from hpctrain.config import Job
    from hpctrain.plan.planner import PlanResult

COMPONENTS = ("weights", "grads", "optimizer", "activations", "other")


@dataclass(frozen=True)
class Prediction:
    """Predicted memory (bytes, most loaded rank) and step-time split (seconds) of one layout."""

    label: str
    memory_bytes: dict[str, float]  # COMPONENTS + "total"
    budget_bytes: Optional[float] = None
    step_time_s: Optional[float] = None
    compute_s: Optional[float] = None
    tp_comm_s: Optional[float] = None
    pp_comm_s: Optional[float] = None
    dp_comm_s: Optional[float] = None  # exposed
    bubble_s: Optional[float] = None
    optimizer_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    comm_share: Optional[float] = None
    bubble_share: Optional[float] = None
    stage_layers: tuple[tuple[int, int], ...] = ()
    stage_imbalance: Optional[float] = None
    peak_rank: Optional[int] = None
    items: tuple[tuple[str, float], ...] = field(default=())  # the planner's named memory items

    @property
    def total_bytes(self) -> float:
        return float(self.memory_bytes.get("total", 0.0))

    def share(self, seconds: Optional[float]) -> Optional[float]:
        if seconds is None or not self.step_time_s:
            return None
        return seconds / self.step_time_s

    def summary(self) -> str:
        """`41.2 of 80.0 GiB, 12,345 tokens/s, MFU 41 %` for fix lines."""
        parts = [f"{self.total_bytes / GIB:.1f}" + (f" of {self.budget_bytes / GIB:.1f}" if self.budget_bytes else "")
                 + " GiB per GPU"]
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        if self.comm_share is not None:
            parts.append(f"comm {100 * self.comm_share:.0f} %")
        if self.bubble_share:
            parts.append(f"bubble {100 * self.bubble_share:.0f} %")
        if self.stage_imbalance:
            parts.append(f"stage imbalance {100 * self.stage_imbalance:.0f} %")
        if self.mfu:
            parts.append(f"MFU {100 * self.mfu:.0f} %")
        return f"{self.label}: " + ", ".join(parts)


def from_layout(layout: Any, budget_bytes: Optional[float]) -> Prediction:
    """From a planner `Layout` (hpctrain.plan.search) and the memory budget."""
    mem, cost = layout.memory, layout.cost
    memory = {name: float(getattr(mem, name)) for name in COMPONENTS}
    memory["total"] = float(mem.total)
    return Prediction(
        label=layout.label(), memory_bytes=memory, budget_bytes=budget_bytes,
        step_time_s=cost.step_time_s, compute_s=cost.compute_s, tp_comm_s=cost.tp_comm_s, pp_comm_s=cost.pp_comm_s,
        dp_comm_s=cost.dp_comm_exposed_s, bubble_s=cost.bubble_s, optimizer_s=cost.optimizer_s,
        tokens_per_s=cost.tokens_per_s, tflops_per_gpu=cost.tflops_per_gpu, mfu=cost.mfu,
        comm_share=cost.comm_share, bubble_share=cost.bubble_share,
        stage_layers=tuple((int(s[0]), int(s[1])) for s in layout.stage_layers),
        stage_imbalance=layout.stage_imbalance, peak_rank=layout.peak_rank, items=tuple(mem.items),
    )


def _number(data: dict[str, Any], *keys: str) -> Optional[float]:
    for key in keys:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def from_plan_json(data: dict[str, Any]) -> Optional[Prediction]:
    """From plan.json (`hpctrain plan --json`): its first layout, or a flat layout object."""
    layouts = data.get("layouts")
    layout = layouts[0] if isinstance(layouts, list) and layouts and isinstance(layouts[0], dict) else data
    mem = layout.get("memory_gib")
    if not isinstance(mem, dict):
        return None
    memory = {k: float(v) * GIB for k, v in mem.items() if isinstance(v, (int, float))}
    memory.setdefault("total", sum(memory.get(k, 0.0) for k in COMPONENTS))
    times: dict[str, Any] = layout["time_s"] if isinstance(layout.get("time_s"), dict) else layout
    cluster: dict[str, Any] = data["cluster"] if isinstance(data.get("cluster"), dict) else {}
    budget_gib = _number(cluster, "memory_budget_gib") or _number(layout, "memory_budget_gib")
    stage_layers = layout.get("stage_layers") or (data.get("placement") or {}).get("stage_layers") or ()
    label = layout.get("label") or " ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "dp", "micro_batch")
                                            if k in layout)
    return Prediction(
        label=str(label), memory_bytes=memory, budget_bytes=budget_gib * GIB if budget_gib else None,
        step_time_s=_number(layout, "step_time_s"), compute_s=_number(times, "compute_s", "compute"),
        tp_comm_s=_number(times, "tp_comm_s", "tp_comm"), pp_comm_s=_number(times, "pp_comm_s", "pp_comm"),
        dp_comm_s=_number(times, "dp_comm_exposed_s", "dp_comm_s", "dp_comm"),
        bubble_s=_number(times, "bubble_s", "bubble"), optimizer_s=_number(times, "optimizer_s", "optimizer"),
        tokens_per_s=_number(layout, "tokens_per_s"), tflops_per_gpu=_number(layout, "tflops_per_gpu"),
        mfu=_number(layout, "mfu"), comm_share=_number(layout, "comm_share"),
        bubble_share=_number(layout, "bubble_share"),
        stage_layers=tuple((int(s[0]), int(s[1])) for s in stage_layers),
        stage_imbalance=_number(layout, "stage_imbalance"),
        peak_rank=layout.get("memory_peak_pp_rank", layout.get("peak_rank")),
        items=tuple((str(k), float(v) * GIB) for k, v in (layout.get("memory_items_gib") or {}).items()
                    if isinstance(v, (int, float))),
    )


def pinned_job_data(job_data: dict[str, Any]) -> dict[str, Any]:
    """The resolved job as plain data without `placement` (the planner recomputes it; fixes that
    change pp would make the old stage split wrong)."""
    return {k: v for k, v in job_data.items() if k != "placement"}


def plan_job(job: Job) -> PlanResult:
    """The planner's `plan_job` (hpctrain.plan.planner)."""
    from hpctrain.plan.planner import plan_job as planner_plan_job

    return planner_plan_job(job)


def predict_job(job: Job) -> Prediction:
    """Plan `job` (normally fully pinned) and return its best layout. Raises ConfigError/PlanError."""
    result = plan_job(job)
    return from_layout(result.best, float(result.budget_bytes))


def predict_run(job_data: Optional[dict[str, Any]],
                plan_json: Optional[dict[str, Any]]) -> tuple[Optional[Prediction], str]:
    """(prediction for the layout that ran, '' or why there is none). Re-plans the pinned resolved
    job first (full detail), falls back to plan.json."""
    problem = "no job.resolved.yaml in the run directory"
    if job_data:
        from hpctrain.config import job_from_dict
        from hpctrain.errors import ConfigError

        try:
            return predict_job(job_from_dict(pinned_job_data(job_data), origin="job.resolved.yaml")), ""
        except (ConfigError, ImportError, ValueError, ZeroDivisionError) as exc:
            problem = f"the planner cannot plan the run's layout: {str(exc).splitlines()[0]}"
    if plan_json:
        prediction = from_plan_json(plan_json)
        if prediction is not None:
            return prediction, ""
    return None, problem
