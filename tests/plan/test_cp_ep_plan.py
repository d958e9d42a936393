"""The planner with context and expert parallelism together (ep borrows its ranks from dp x cp x tp, the runtime's
rule: runtime/parallel/dims.py, runtime/parallel/expert.py): the layout rule, the search, the experts' states over
efsdp = dp x cp x tp / ep, the all-to-all at the cp token share, and the placement's ep groups. Torch-free."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.plan import plan_job, resolve_job
from hpctrain.plan.comm import ep_placement, pipeline_outermost
from hpctrain.plan.cost import step_cost
from hpctrain.plan.cost_setup import CostSetup
from hpctrain.plan.moe_cost import moe_a2a_per_micro_batch_s
from hpctrain.plan.hardware import resolve_hardware
from hpctrain.plan.memory import rank_memory
from hpctrain.plan.rank_setup import RankSetup
from hpctrain.plan.model_stats import stage_param_count, stage_routed_expert_params
from hpctrain.plan.placement import rank_order
from hpctrain.plan.space import ep_layout_problem
from hpctrain.plan.stages import balanced_stage_split

MOE = dict(layers=4, hidden=256, heads=4, kv_heads=2, ffn_hidden=512, vocab=1024, seq_len=16384, activation="swiglu",
           moe=dict(experts=16, top_k=2, expert_ffn_hidden=256))


def _job(**parallel):
    return job_from_dict({
        "name": "cpep", "model": {"preset": None, **MOE},
        "train": {"global_batch": 16, "micro_batch": "auto", "activation_checkpointing": "auto"},
        "parallel": {"tp": "auto", "pp": "auto", "dp": "auto", "zero": "auto", "sequence_parallel": True, **parallel},
        "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}})


@pytest.mark.parametrize("ep, dp, cp, tp, ok", [
    (2, 1, 2, 1, True),   # the ep group is the cp group
    (4, 2, 2, 1, True),   # over dp x cp
    (4, 1, 2, 2, True),   # over cp x tp, a multiple of tp
    (8, 1, 4, 2, True),
    (4, 1, 2, 1, False),  # more than dp x cp x tp
    (2, 1, 2, 4, False),  # not a multiple of tp
    (8, 3, 2, 1, False),  # does not divide 6
])
def test_ep_divides_dp_x_cp_x_tp(ep, dp, cp, tp, ok):
    problem = ep_layout_problem(ep, dp, tp, tp > 1, True, cp)
    assert (problem is None) == ok, problem
    if not ok and ep % tp == 0:
        assert f"dp x cp x tp = {dp * cp * tp}" in problem


def test_the_search_tries_cp_with_ep_and_resolves_both():
    job = _job(cp=2, ep="auto")
    result = plan_job(job)
    folded = [lay for lay in result.layouts if lay.cp == 2 and lay.ep > 1]
    assert {lay.ep for lay in folded} >= {2, 4, 8, 16}
    # ep over more ranks than dp x tp: only with cp folded in (dp x tp = 8 of the 16 GPUs at cp 2)
    assert any(lay.ep > lay.dp * lay.tp for lay in folded)
    for lay in result.layouts:
        assert ep_layout_problem(lay.ep, lay.dp, lay.tp, lay.sequence_parallel, True, lay.cp) is None
        assert (lay.cost.a2a_s > 0) == (lay.ep > 1)
    resolved, _ = resolve_job(_job(cp=2, ep=4, tp=1, pp=1, sequence_parallel=False))
    assert (resolved.parallel.cp, resolved.parallel.ep, resolved.parallel.dp) == (2, 4, 8)


def _setup(**kw) -> RankSetup:
    base = dict(tp=1, pp=1, dp=2, micro_batch=1, micro_batches=1, schedule="none", virtual_stages=1, ac="none", zero=1,
                offload_optimizer=False, sequence_parallel=False, precision="bf16", optimizer="adamw", foreach=False,
                overhead_bytes=0.0)
    return RankSetup(**{**base, **kw})


def test_experts_states_over_efsdp_dp_x_cp_x_tp_over_ep_and_the_rest_over_dp_x_cp():
    m = _job().model
    split = balanced_stage_split(m, 1, 1)
    for dp, cp, tp, ep, efsdp in ((2, 2, 1, 2, 2), (2, 2, 1, 4, 1), (1, 4, 2, 4, 2), (2, 4, 1, 2, 4)):
        s = _setup(dp=dp, cp=cp, tp=tp, ep=ep, sequence_parallel=tp > 1)
        assert s.efsdp == efsdp
        full = stage_param_count(m, 0, 4, has_embedding=True, has_head=True, tp=tp, ep=ep)
        experts = stage_routed_expert_params(m, 0, 4, ep=ep)
        items = dict(rank_memory(m, split, s, 0).items)
        assert items["fp32 master weights"] == pytest.approx(4 * ((full - experts) / (dp * cp) + experts / efsdp))
    # At fixed dp x cp the experts' sharded states do not depend on how the ranks split into dp and cp.
    a, b = (dict(rank_memory(m, split, _setup(dp=dp, cp=cp, ep=4), 0).items) for dp, cp in ((4, 1), (2, 2)))
    assert a["fp32 master weights"] == pytest.approx(b["fp32 master weights"])
    assert a["saved activations"] > b["saved activations"]  # a cp rank holds half the tokens


def test_the_all_to_all_moves_the_cp_token_share():
    """step_cost prices each micro-batch's dispatch with the rank's tokens, micro_batch x seq_len / cp: at cp 2 the
    all-to-alls of one micro-batch carry half the rows of cp 1's (their time less than cp 1's, more than half
    of it: the latency terms stay)."""
    m = _job().model
    hw = resolve_hardware(_job())

    def cost(cp: int) -> CostSetup:
        return CostSetup(tp=1, pp=1, dp=8 // cp * cp, cp=cp, micro_batch=1, micro_batches=1, virtual_stages=1, ac="none",
                         zero=1, offload_optimizer=False, precision="bf16", max_rank_layers=4, max_rank_has_head=True,
                         rank_params=1e8, ep=4)

    per_mb = {cp: moe_a2a_per_micro_batch_s(m, hw, cost(cp), m.seq_len // cp, 2) for cp in (1, 2)}
    assert per_mb[1] / 2 < per_mb[2] < per_mb[1]
    for cp in (1, 2):
        assert step_cost(m, hw, cost(cp), 16).a2a_s == pytest.approx(per_mb[cp])


@pytest.mark.parametrize("tp, pp, dp, cp, ep, gpus_per_node", [
    (1, 1, 2, 2, 2, 8), (1, 2, 2, 2, 4, 8), (2, 2, 1, 2, 4, 4), (2, 1, 2, 4, 8, 8), (1, 2, 4, 2, 8, 8),
])
def test_the_placement_keeps_each_ep_group_on_consecutive_slots(tp, pp, dp, cp, ep, gpus_per_node):
    """The runtime's ep group: ep consecutive ranks of a stage's (dp, cp, tp) grid (the global rank
    ((p * dp + d) * cp + c) * tp + t, runtime/parallel/dims.py); the planner places dp x cp as its dp
    (plan/planner.py) and, with ep > 1, walks tp, then dp x cp, then pp (pipeline_outermost): every ep group
    lands on consecutive slots, as many per node as comm.ep_placement prices."""
    world = tp * pp * dp * cp
    order = rank_order(tp, pp, dp * cp, gpus_per_node, pipeline_outermost=pipeline_outermost(ep)) or list(range(world))
    slot_of = {rank: slot for slot, rank in enumerate(order)}
    stage = dp * cp * tp
    for first in range(0, world, ep):
        slots = sorted(slot_of[r] for r in range(first, first + ep))
        assert first // stage == (first + ep - 1) // stage  # inside one stage
        assert slots == list(range(slots[0], slots[0] + ep))
        in_first_node = sum(1 for s in slots if s // gpus_per_node == slots[0] // gpus_per_node)
        assert in_first_node == min(ep, gpus_per_node)
    hw = resolve_hardware(_job())  # 8 GPUs a node
    assert ep_placement(hw, tp, pp, ep).in_node == min(ep, hw.gpus_per_node)
