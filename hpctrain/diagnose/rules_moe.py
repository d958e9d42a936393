"""Mixture-of-Experts findings, from the metrics the runtime logs for `model.moe` (docs/architecture.md
section 3): a collapsed router, and an expert-parallel all-to-all that takes too much of the step.

A collapsed router sends most tokens to a few experts: `expert_load_max_over_mean` (the busiest expert's
tokens over the mean, the worst MoE layer of the step) stays above `thresholds.router_load` on each of the
last `COLLAPSED_STEPS` logged steps. A spike early in training is normal (the router starts random);
a load that stays lopsided wastes the idle experts' parameters and, under expert parallelism, makes the
busiest rank the step's straggler. The fixes turn balancing on or strengthen it: the Switch Transformer
loss (Fedus et al. 2021, section 2.2; 0.01 is their default) or DeepSeek-V3's bias update (Liu et al.
2024, section 2.1.2; 0.001).
"""

from __future__ import annotations

from typing import Any

from hpctrain.diagnose import candidates as cand
from hpctrain.diagnose.context import Context, measured_share
from hpctrain.diagnose.findings import WARNING, Finding, Fix, pct
from hpctrain.diagnose.fixes import validated

COLLAPSED_STEPS = 5  # logged steps in a row: fewer is a transient
LOAD = "expert_load_max_over_mean"
ALL_TO_ALL = "time_all_to_all_s"  # logged only when parallel.ep > 1


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def router_collapse_rule(ctx: Context) -> list[Finding]:
    """The busiest expert above `router_load` x the mean on each of the last COLLAPSED_STEPS logged steps."""
    loads = [(int(m["step"]), float(m[LOAD])) for m in ctx.run.metrics
             if isinstance(m.get(LOAD), (int, float)) and not isinstance(m.get(LOAD), bool)]
    recent = loads[-COLLAPSED_STEPS:]
    limit = ctx.thresholds.router_load
    if len(recent) < COLLAPSED_STEPS or min(load for _, load in recent) <= limit:
        return []
    moe = _mapping(ctx.section("model").get("moe"))
    router = _mapping(moe.get("router"))
    experts = moe.get("experts")
    evidence = [f"steps {recent[0][0]}-{recent[-1][0]}: the busiest expert got {min(v for _, v in recent):.1f}-"
                f"{max(v for _, v in recent):.1f}x the mean load (threshold {limit:g}x)"]
    if isinstance(experts, int) and isinstance(moe.get("top_k"), int):
        evidence.append(f"{experts} experts, top-{moe['top_k']}: at most {experts / moe['top_k']:.1f}x when every "
                        "token picks the same experts")
    coeff = float(router.get("aux_loss_coeff") or 0.0)
    evidence.append(f"balancing: aux_loss_coeff {coeff:g}, bias_update_rate {router.get('bias_update_rate')}")
    fixes: list[Fix] = []
    for why, sets in (
        ("add the load-balancing loss" if coeff <= 0 else "strengthen the load-balancing loss",
         [f"model.moe.router.aux_loss_coeff={max(0.01, coeff * 10):g}"]),
        ("balance with a per-expert routing bias instead (no loss term)", ["model.moe.router.bias_update_rate=0.001"]),
    ):
        if "bias_update_rate" in sets[0] and router.get("bias_update_rate"):
            continue
        fix = validated(why, sets, ctx.run.job_data)
        if fix is not None:
            fixes.append(fix)
    return [Finding("router", WARNING, f"the MoE router has collapsed: one expert takes {recent[-1][1]:.1f}x the "
                    "mean load", tuple(evidence), tuple(fixes))]


def all_to_all_rule(ctx: Context) -> list[Finding]:
    """Expert parallelism's all-to-all waits above the communication rule's threshold of the step time.

    The runtime times them on their own (runtime/observe/comm_timing.py) and counts them in the exposed
    communication too, so the communication finding may come with this one; this one names the cause. The
    fixes: fewer ep ranks (fewer tokens leave their rank; each rank holds more experts) or a larger
    micro-batch (fewer, larger exchanges per step)."""
    share = measured_share(ctx.run, ALL_TO_ALL)
    limit = ctx.thresholds.comm_share
    if share is None or share[0] <= limit:
        return []
    ep = ctx.section("parallel").get("ep")
    ep = ep if isinstance(ep, int) and not isinstance(ep, bool) else 1
    evidence = [f"the expert-parallel all-to-all is {pct(share[0])} of the step time ({share[1]}); threshold "
                f"{pct(limit)} (the communication rule's)",
                f"parallel.ep={ep}: every MoE layer sends each routed token to its expert's rank and back, in "
                "forward and again in backward"]
    fixes: list[Fix] = []
    options: list[tuple[str, tuple[str, ...]]] = [(f"fewer expert-parallel ranks (ep {ep} -> {ep // 2}): fewer tokens leave their rank, each rank "
                "holds twice the experts", (f"parallel.ep={ep // 2}",))] if ep > 1 else []
    options += [(c.why, c.sets) for c in cand.larger_micro_batch(ctx.run.layout)]
    for why, sets in options:
        fix = validated(why, sets, ctx.run.job_data)
        if fix is not None:
            fixes.append(fix)
    return [Finding("all_to_all", WARNING, f"the expert-parallel all-to-all takes {pct(share[0])} of each step",
                    tuple(evidence), tuple(fixes))]
