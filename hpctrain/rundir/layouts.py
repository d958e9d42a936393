"""The layouts a run has had: the degrees of a resolved job as one small record, and its wording.

Elastic jobs re-plan at each start (hpctrain/launch/replan.py) and record a `layout_changed` event with
the old and the new record; status, the doctor and the report read them back with these functions.
"""

from __future__ import annotations

from typing import Any

LAYOUTS_DIR = "layouts"  # under submit/: attempt-A.resolved.yaml, the job each attempt ran
LAYOUT_KEYS = ("nodes", "tp", "pp", "dp", "micro_batch", "grad_accumulation")


def mapping(value: Any) -> dict[str, Any]:
    """value when it is a JSON object, else {}: a run's records are read back whatever a hand or a bad disk
    left in them (a `layout_changed` whose `old` is a string is no layout, not a crash)."""
    return value if isinstance(value, dict) else {}


def layout_of(resolved: dict[str, Any]) -> dict[str, Any]:
    """{nodes, tp, pp, dp, micro_batch, grad_accumulation} of a resolved job (as a plain mapping)."""
    cluster, parallel, train = (mapping(resolved.get(k)) for k in ("cluster", "parallel", "train"))
    out = {"nodes": cluster.get("nodes"), "tp": parallel.get("tp"), "pp": parallel.get("pp"),
           "dp": parallel.get("dp"), "micro_batch": train.get("micro_batch")}
    mb, dp, batch = out["micro_batch"], out["dp"], train.get("global_batch")
    out["grad_accumulation"] = None
    if isinstance(mb, int) and isinstance(dp, int) and isinstance(batch, int) and \
            not any(isinstance(v, bool) or v <= 0 for v in (mb, dp, batch)):
        out["grad_accumulation"] = batch // (mb * dp)
    return out


def describe(layout: Any) -> str:
    """`nodes=2 tp=1 pp=1 dp=8 micro_batch=1 grad_accumulation=4` (keys in LAYOUT_KEYS order)."""
    layout = mapping(layout)
    return " ".join(f"{k}={layout.get(k)}" for k in LAYOUT_KEYS if layout.get(k) is not None) or "(not recorded)"
