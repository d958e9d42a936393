"""Planner: hardware catalog, memory and cost models, layout search, topology. Pure Python; never imports torch.

    from hpctrain.plan import plan_job, resolve_job
    result = plan_job(job)                 # PlanResult: ranked layouts, rejections; .to_json(top)
    resolved, result = resolve_job(job)    # every "auto" filled from the best layout, placement set

The FLOP formula the runtime's MFU uses is `hpctrain.plan.model_stats.flops_per_token`.
"""

from typing import Any

# Names -> defining module. Loaded on first use (PEP 562) so that `hpctrain validate`, which needs only
# the catalog, does not pay for the search and cost models.
_EXPORTS = {
    "check_catalog_names": "hpctrain.plan.hardware",
    "flops_per_token": "hpctrain.plan.model_stats",
    "model_flops_per_token": "hpctrain.plan.model_stats",
    "param_count": "hpctrain.plan.model_stats",
    "PlanResult": "hpctrain.plan.planner",
    "plan_job": "hpctrain.plan.planner",
    "resolve_job": "hpctrain.plan.planner",
    "balanced_stage_split": "hpctrain.plan.stages",
    "stage_imbalance": "hpctrain.plan.stages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hpctrain.plan' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
