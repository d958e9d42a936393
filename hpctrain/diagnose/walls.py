"""`hpctrain plan` explains itself: one line each on the memory, compute and communication walls.

    from hpctrain.diagnose.walls import explain_walls
    for line in explain_walls(job, result.best, budget_bytes=result.budget_bytes): print(line)

`layout` is a planner `Layout` (hpctrain.plan.search) or one layout object of plan.json. Pure
Python, no torch: it runs inside `hpctrain plan` on the login node.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from hpctrain.diagnose.findings import GIB
from hpctrain.diagnose.predict import Prediction, from_layout, from_plan_json

ADVICE = {
    "weights": "more TP or PP, or zero 3, splits them",
    "grads": "zero 2 or 3 shards them over dp",
    "optimizer": "zero 1+ shards them over dp; offload_optimizer moves them to the CPU",
    "activations": "activation checkpointing, a smaller micro-batch, sequence parallel or more TP shrink them",
    "other": "runtime overhead and buffers (cluster.runtime_overhead_gib sets the reserve)",
}

NAMES = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer states", "activations": "activations",
         "other": "runtime overhead and buffers"}


def _prediction(layout: Any, budget_bytes: Optional[float]) -> Prediction:
    if isinstance(layout, Prediction):
        return layout
    if isinstance(layout, dict):
        pred = from_plan_json({"layouts": [layout]})
        if pred is None:
            raise ValueError("layout: plan.json layout without memory_gib")
        return pred if budget_bytes is None else replace(pred, budget_bytes=budget_bytes)
    return from_layout(layout, budget_bytes)


def _dims(layout: Any) -> dict[str, Any]:
    get = layout.get if isinstance(layout, dict) else (lambda k, d=None: getattr(layout, k, d))
    return {k: get(k) for k in ("tp", "pp", "dp", "micro_batch", "ac", "zero", "schedule", "virtual_stages")}


def memory_wall(p: Prediction, dims: dict[str, Any]) -> str:
    mem = p.memory_bytes
    total = p.total_bytes or 1.0
    name = max(("weights", "grads", "optimizer", "activations", "other"), key=lambda k: mem.get(k, 0.0))
    used = f"{total / GIB:.1f}" + (f" of {p.budget_bytes / GIB:.1f} GiB per GPU ({100 * total / p.budget_bytes:.0f} %)"
                                   if p.budget_bytes else " GiB per GPU")
    where = f" on pipeline rank {p.peak_rank}" if p.peak_rank is not None and (dims.get("pp") or 1) > 1 else ""
    biggest = max(p.items, key=lambda kv: kv[1])[0] if p.items else name
    return (f"memory wall: {used}{where}; {NAMES[name]} dominate ({mem.get(name, 0.0) / GIB:.1f} GiB, "
            f"{100 * mem.get(name, 0.0) / total:.0f} %; largest item: {biggest}) — {ADVICE[name]}")


def compute_wall(job: Any, p: Prediction, dims: dict[str, Any]) -> str:
    from hpctrain.plan.hardware import resolve_hardware
    from hpctrain.plan.model_stats import flops_per_token

    ac = str(dims["ac"]) if dims.get("ac") in ("none", "selective", "full") else "none"
    tokens = int(job.train.global_batch) * int(job.model.seq_len)
    world = job.cluster.nodes * job.cluster.gpus_per_node
    flops_gpu = flops_per_token(job.model, ac) * tokens / world
    try:
        peak = resolve_hardware(job).gpu.peak_flops_per_s(job.train.precision)
    except (ValueError, KeyError):
        peak = 0.0
    share = p.share(p.compute_s)
    parts = [f"compute wall: {flops_gpu / 1e12:,.1f} TFLOP per GPU per step"
             + (f" (recompute {ac} included)" if ac != "none" else "")]
    if share is not None and p.compute_s is not None:
        parts.append(f"compute is {100 * share:.0f} % of the {p.step_time_s:.3f} s step")
    if p.tflops_per_gpu is not None and peak:
        parts.append(f"{p.tflops_per_gpu:.0f} of {peak / 1e12:.0f} TFLOP/s peak, MFU {100 * (p.mfu or 0):.0f} %")
    return "; ".join(parts)


def communication_wall(p: Prediction, dims: dict[str, Any]) -> str:
    terms = [("TP", p.tp_comm_s, f"tp={dims.get('tp')}"), ("PP", p.pp_comm_s, f"pp={dims.get('pp')}"),
             ("DP", p.dp_comm_s, f"dp={dims.get('dp')} zero {dims.get('zero')}"), ("bubble", p.bubble_s, "")]
    shown = [(name, p.share(s) or 0.0, what) for name, s, what in terms if s]
    if p.comm_share is None and not shown:
        return "communication wall: no communication estimate for this layout"
    comm = p.comm_share if p.comm_share is not None else sum(share for name, share, _ in shown if name != "bubble")
    if not shown:
        return f"communication wall: {100 * comm:.0f} % of the step is exposed communication"
    detail = ", ".join(f"{name} {100 * share:.0f} %" + (f" ({what})" if what else "") for name, share, what in shown)
    worst = max(shown, key=lambda item: item[1])[0]
    verdict = "not a wall" if comm + (p.bubble_share or 0.0) < 0.15 else f"{worst} is the largest"
    return f"communication wall: {100 * comm:.0f} % of the step is exposed communication — {detail}; {verdict}"


def explain_walls(job: Any, layout: Any, budget_bytes: Optional[float] = None) -> list[str]:
    """Three lines (memory, compute, communication) for a planned layout of `job`."""
    p = _prediction(layout, budget_bytes)
    dims = _dims(layout) if not isinstance(layout, Prediction) else {}
    return [memory_wall(p, dims), compute_wall(job, p, dims), communication_wall(p, dims)]
