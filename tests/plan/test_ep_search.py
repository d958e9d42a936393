"""parallel.ep: auto (issue 26 item 1): the planner searches ep over the divisors of the experts that fit each
(dp, tp), resolves it to an integer, and ranks an ep group that crosses nodes by its all-to-all. Torch-free."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import ConfigError
from hpctrain.plan import plan_job, resolve_job
from hpctrain.plan.space import Choices, ep_candidates, ep_layout_problem

MOE = dict(layers=4, hidden=256, heads=4, kv_heads=2, ffn_hidden=512, vocab=1024, seq_len=512, activation="swiglu",
           moe=dict(experts=16, top_k=2, expert_ffn_hidden=256))


def _job(ep="auto", nodes=2, **parallel):
    return job_from_dict({
        "name": "ep", "model": {"preset": None, **MOE},
        "train": {"global_batch": 64, "micro_batch": "auto", "activation_checkpointing": "auto"},
        "parallel": {"tp": "auto", "pp": "auto", "dp": "auto", "ep": ep, "zero": "auto", "sequence_parallel": True,
                     **parallel},
        "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100",
                    "fabric": "ib-ndr400"}})


def test_ep_auto_is_accepted_and_expands_to_the_experts_divisors():
    job = _job()
    assert job.parallel.ep == "auto"
    assert Choices.from_job(job).ep == (1, 2, 4, 8, 16)
    assert ep_candidates(4, job.model, 16) == (4,)
    dense = job_from_dict({"name": "d", "model": {"preset": "tiny"}, "parallel": {"ep": "auto"}})
    assert ep_candidates(dense.parallel.ep, dense.model, 8) == (1,)


def test_ep_auto_search_tries_every_fitting_ep_and_resolves_an_integer():
    job = _job()
    result = plan_job(job)
    eps = {lay.ep for lay in result.layouts}
    assert {1, 2, 4, 8, 16} <= eps  # an ep of 16 over two nodes is ranked, not forbidden
    for lay in result.layouts:
        assert ep_layout_problem(lay.ep, lay.dp, lay.tp, lay.sequence_parallel, True) is None
        assert (lay.cost.a2a_s > 0) == (lay.ep > 1)
    resolved, _ = resolve_job(job)
    assert isinstance(resolved.parallel.ep, int) and resolved.parallel.ep == result.best.ep


def test_crossing_nodes_is_ranked_below_the_same_layout_inside_a_node():
    result = plan_job(_job())
    def best_with(ep):
        return next(lay for lay in result.layouts if lay.ep == ep and lay.tp == 1 and lay.pp == 1)
    inside, across = best_with(8), best_with(16)
    assert across.cost.a2a_crosses_nodes and not inside.cost.a2a_crosses_nodes
    assert across.cost.a2a_s > inside.cost.a2a_s


def test_the_runtime_refuses_an_unresolved_ep():
    from hpctrain.runtime.parallel.dims import ParallelDims

    job = _job(tp=1, pp=1, dp=16, sequence_parallel=False)
    with pytest.raises(ConfigError, match="parallel.ep"):
        ParallelDims.from_job(job, 16)
