"""`plan`'s advice (issue 26 item 4): what bounds the best layout, by what share of the step, and the next-best
layout of another shape with its step-time delta. On the issue's case: Qwen3-235B-A22B on 256 H100s (32 DGX
H100 nodes, NDR400), every dimension free, parallel.ep auto. Facts, not prose. Torch-free."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.plan import plan_job
from hpctrain.plan.report import BOUND_PARTS, MEMORY_BOUND_SHARE, render_text, shape, step_shares


def _plan(ep):
    """The issue's case, with `ep` auto or fixed."""
    return plan_job(job_from_dict({
        "name": "qwen3-235b-256", "model": {"preset": "qwen3-235b-a22b", "seq_len": 4096},
        "train": {"global_batch": 1024, "micro_batch": "auto", "activation_checkpointing": "auto"},
        "parallel": {"tp": "auto", "pp": "auto", "dp": "auto", "ep": ep, "schedule": "auto",
                     "virtual_stages": "auto", "zero": "auto", "sequence_parallel": True},
        "cluster": {"nodes": 32, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}}))


@pytest.fixture(scope="module")
def result():
    return _plan("auto")


@pytest.fixture(scope="module")
def ep8():
    """The same job with expert parallelism fixed at 8 (one node per expert group)."""
    return _plan(8)


def test_the_bound_is_the_largest_share_of_the_step(result, ep8):
    advice = result.to_json(top=5)["advice"]
    best = result.best
    shares = step_shares(best)
    assert set(advice["shares"]) == set(BOUND_PARTS)
    assert advice["time_bound"] == max(shares, key=lambda k: shares[k])
    assert advice["time_bound_share"] == pytest.approx(shares[advice["time_bound"]], abs=1e-4)
    memory_share = best.memory.total / result.budget_bytes
    assert advice["memory_share"] == pytest.approx(memory_share, abs=1e-4)
    assert advice["bound"] == ("memory" if memory_share >= MEMORY_BOUND_SHARE else advice["time_bound"])
    # the shares are parts of the step: they sum to about one (the embedding's host transfer aside)
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.02)
    # an expert-parallel layout has its all-to-all costed; one without experts split has none
    assert ep8.best.ep == 8 and step_shares(ep8.best)["all-to-all"] > 0
    assert ep8.to_json(top=1)["advice"]["shares"]["all-to-all"] == pytest.approx(step_shares(ep8.best)["all-to-all"],
                                                                                abs=1e-4)
    assert best.ep > 1 or advice["shares"]["all-to-all"] == 0


def test_the_alternative_has_another_shape_and_a_consistent_delta(result):
    alt = result.to_json(top=5)["advice"]["alternative"]
    best = result.best
    assert alt is not None
    assert (alt["tp"], alt["pp"], alt["cp"], alt["ep"]) != shape(best)
    assert alt["step_time_s"] >= best.cost.step_time_s
    assert alt["step_time_delta"] == pytest.approx(alt["step_time_s"] / best.cost.step_time_s - 1, abs=1e-3)
    assert alt["step_time_delta"] > 0
    # no layout of another shape is faster than the one named
    faster = [lay for lay in result.layouts if shape(lay) not in (shape(best), (alt["tp"], alt["pp"], alt["cp"],
                                                                                    alt["ep"]))]
    assert all(lay.cost.step_time_s >= alt["step_time_s"] - 1e-6 for lay in faster)


def test_the_report_prints_both(result, ep8):
    text = render_text(result, 5)
    alt = result.to_json(top=5)["advice"]["alternative"]
    assert f"{alt['step_time_delta']:+.0%}" in text
    assert alt["label"] in text
    # with ep > 1 on hpctrain's runtime each MoE block's host sync is costed and shown
    c = ep8.best.cost
    assert c.host_s > 0 and ep8.to_json(top=1)["layouts"][0]["time_s"]["moe_host_sync"] == round(c.host_s, 6)
    assert f"MoE host syncs {c.host_s / c.step_time_s:.1%} ({c.host_s:.3f} s" in render_text(ep8, 5)


def test_the_placement_of_an_expert_parallel_layout_keeps_its_ep_groups_inside_nodes(result):
    # The rank order the run gets (plan.json / job.resolved.yaml's placement) is the one the cost model priced:
    # with ep > 1 the pipeline is outermost, so each ep group's ranks (ep consecutive ranks of a stage's
    # dp x tp grid) share a node when ep <= 8; a dense layout keeps its pipeline inside the node first.
    from hpctrain.plan.comm import ep_placement

    gpus_per_node = result.hardware.gpus_per_node
    for lay in result.layouts[:20]:
        if lay.ep <= 1:
            continue
        order = result.placement(lay).rank_order
        slot_of = {rank: slot for slot, rank in enumerate(order or range(lay.tp * lay.pp * lay.dp))}
        stage_ranks = lay.dp * lay.tp
        where = ep_placement(result.hardware, lay.tp, lay.pp, lay.ep)
        for stage in range(lay.pp):
            for first in range(0, stage_ranks, lay.ep):
                nodes = {slot_of[stage * stage_ranks + first + i] // gpus_per_node for i in range(lay.ep)}
                assert len(nodes) == where.nodes, (lay.label(), stage, first)
