"""Planner: hardware catalog, memory and cost models, layout search, topology. Pure Python; never imports torch.

    from hpctrain.plan import plan_job, resolve_job
    result = plan_job(job)                 # PlanResult: ranked layouts, rejections; .to_json(top)
    resolved, result = resolve_job(job)    # every "auto" filled from the best layout, placement set

The FLOP formula the runtime's MFU uses is `hpctrain.plan.model_stats.flops_per_token`.
"""

from hpctrain.plan.hardware import check_catalog_names
from hpctrain.plan.model_stats import flops_per_token, model_flops_per_token, param_count
from hpctrain.plan.planner import PlanResult, plan_job, resolve_job
from hpctrain.plan.stages import balanced_stage_split, stage_imbalance

__all__ = ["PlanResult", "balanced_stage_split", "check_catalog_names", "flops_per_token", "model_flops_per_token",
           "param_count", "plan_job", "resolve_job", "stage_imbalance"]
