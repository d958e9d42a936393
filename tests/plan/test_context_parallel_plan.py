"""The planner with context parallelism (plan/context.py, issue 25): cp candidates for long sequences,
activations divided by cp plus the K/V buffers, FSDP over dp x cp, and `hpctrain plan` at 128K tokens."""

from __future__ import annotations

from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import PlanError
from hpctrain.plan.context import (
    cp_candidates,
    cp_kv_extra_bytes,
    cp_output_join_bytes,
    cp_ring_buffer_bytes,
    cp_ring_exposed_s,
    cp_ring_saved_delta_bytes,
)
from hpctrain.plan.memory import rank_memory
from hpctrain.plan.rank_setup import GIB, RankSetup
from hpctrain.plan.planner import plan_job, resolve_job

LLAMA3_405B = dict(preset=None, layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256,
                   rope_theta=500000.0)


def _job(model: dict[str, Any], nodes: int, global_batch: int, **parallel: Any) -> Any:
    return job_from_dict({"name": "long", "model": {**model, "seq_len": 131072},
                          "train": {"global_batch": global_batch, "precision": "bf16"},
                          "parallel": parallel,
                          "cluster": {"executor": "slurm", "nodes": nodes, "gpus_per_node": 8, "gpu": "h100-80gb"}})


@pytest.mark.parametrize("model, nodes, batch", [({"preset": "llama3-8b"}, 1, 8), (LLAMA3_405B, 2048, 128)],
                         ids=["llama3-8b on 8 H100", "llama3-405b on 16384 H100"])
def test_plan_at_128k_tokens_proposes_a_context_parallel_layout_that_fits(model: dict[str, Any], nodes: int,
                                                                          batch: int) -> None:
    result = plan_job(_job(model, nodes, batch))
    best = result.best
    assert best.cp > 1 and best.memory.total <= result.budget_bytes
    assert best.tp * best.pp * best.dp * best.cp == nodes * 8
    assert result.to_json()["layouts"][0]["cp"] == best.cp
    resolved, _ = resolve_job(_job(model, nodes, batch))
    assert resolved.parallel.cp == best.cp and resolved.parallel.dp == best.dp
    print(f"[cp plan] {result.job_name} {nodes * 8} GPUs: {best.label()} {best.memory.total / GIB:.1f} GiB")


def test_without_context_parallelism_nothing_fits_llama3_8b_at_128k() -> None:
    """The same job with cp fixed at 1 (the search's candidates restricted): the planner reports no fit."""
    from hpctrain.plan import space

    job = _job({"preset": "llama3-8b"}, 1, 8)
    original = space.cp_candidates
    space.cp_candidates = lambda job_cp, seq_len, world: (1,)  # type: ignore[assignment]
    try:
        with pytest.raises(PlanError, match="no layout"):
            plan_job(job)
    finally:
        space.cp_candidates = original


def test_cp_candidates() -> None:
    assert cp_candidates(1, 8192, 64) == (1,)  # a short sequence: no CP
    assert cp_candidates(4, 131072, 64) == (4,)  # the job's own degree only
    assert cp_candidates(1, 131072, 24) == (1, 2, 4, 8)  # powers of two dividing the GPUs
    assert cp_candidates(1, 3 * 2**14, 64) == (1, 2, 4, 8, 16, 32, 64)


def _setup(**kw: Any) -> RankSetup:
    base = dict(tp=1, pp=1, dp=1, micro_batch=1, micro_batches=1, schedule="none", virtual_stages=1, ac="none",
                zero=1, offload_optimizer=False, sequence_parallel=False, precision="bf16", optimizer="adamw",
                overhead_bytes=0.0)
    return RankSetup(**{**base, **kw})  # type: ignore[arg-type]


def test_activations_divide_by_cp_plus_the_kv_buffers_and_fsdp_shards_over_dp_x_cp() -> None:
    model = _job({"preset": "llama3-8b"}, 1, 8).model

    def items(**kw: Any) -> dict[str, float]:
        return dict(rank_memory(model, [(0, model.layers)], _setup(**kw), 0).items)

    one, cp2, cp4 = items(dp=2), items(dp=1, cp=2), items(dp=1, cp=4)
    per_layer = model.layers * (cp_kv_extra_bytes(model, 1, 4, 1, 2.0) + cp_output_join_bytes(model, 1, 4, 1, 2.0))
    # the same rank states: FSDP over dp x cp = 2 in both cases
    assert cp2["fp32 master weights"] == one["fp32 master weights"]
    assert cp4["fp32 master weights"] == pytest.approx(one["fp32 master weights"] / 2)
    saved_one = items(dp=1)["saved activations"]
    assert cp4["saved activations"] < cp2["saved activations"] < saved_one
    embedding = 131072 * 8  # the token ids the embedding keeps (int64), per rank's tokens
    assert cp4["saved activations"] - per_layer == pytest.approx((saved_one - embedding) / 4 + embedding / 4, rel=1e-9)


def test_ring_saves_its_own_kv_heads_instead_of_the_whole_sequences_kv() -> None:
    """parallel.cp_rotate: ring: per layer, none of the other ranks' K/V and no joined output is saved, and the
    layer's own K/V are saved with the kv heads (GQA: 8 of 32 for Llama 3 8B), not repeated."""
    model = _job({"preset": "llama3-8b"}, 1, 8).model

    def saved(**kw: Any) -> float:
        return dict(rank_memory(model, [(0, model.layers)], _setup(dp=1, cp=4, **kw), 0).items)["saved activations"]

    allgather, ring = saved(), saved(cp_rotate="ring")
    tokens, width = 131072 // 4, 128  # tokens per rank, head_dim
    per_layer_allgather = cp_kv_extra_bytes(model, 1, 4, 1, 2.0) + cp_output_join_bytes(model, 1, 4, 1, 2.0)
    ring_delta = -2 * tokens * (32 - 8) * width * 2.0  # bf16 K and V, 24 repeated heads fewer
    assert cp_ring_saved_delta_bytes(model, 1, 4, 1, 2.0) == ring_delta
    assert allgather - ring == pytest.approx(model.layers * (per_layer_allgather - ring_delta), rel=1e-12)
    # what the ring holds while a layer's attention runs grows with the tokens per rank, the all-gathered K/V
    # with the whole sequence
    assert cp_ring_buffer_bytes(model, 1, 8, 1, 2.0) == pytest.approx(cp_ring_buffer_bytes(model, 1, 4, 1, 2.0) / 2)
    assert cp_kv_extra_bytes(model, 1, 8, 1, 2.0) > cp_kv_extra_bytes(model, 1, 4, 1, 2.0)


@pytest.mark.parametrize("cp, kv_s, grad_s, block_s, recompute, want", [
    (1, 1.0, 2.0, 0.0, False, 0.0),           # no context parallelism
    (4, 1.0, 2.0, 10.0, False, 2.0),          # every transfer hidden but the last accumulator send
    (4, 3.0, 2.0, 1.0, False, 3 * 2.0 + 3 * 3.0 + 2.0),  # forward 3 x (3-1), backward 3 x (5-2) + 2
    (4, 3.0, 2.0, 1.0, True, 2 * 3 * 2.0 + 3 * 3.0 + 2.0),  # full recomputation runs the forward ring again
])
def test_ring_exposed_time_is_what_the_transfers_take_beyond_their_blocks(cp: int, kv_s: float, grad_s: float,
                                                                          block_s: float, recompute: bool,
                                                                          want: float) -> None:
    assert cp_ring_exposed_s(cp, kv_s, grad_s, block_s, recompute) == pytest.approx(want)


def test_plan_at_128k_with_the_ring_fits_and_exposes_less_cp_communication() -> None:
    job = {"preset": "llama3-8b"}
    allgather, ring = plan_job(_job(job, 1, 8)).best, plan_job(_job(job, 1, 8, cp_rotate="ring")).best
    assert ring.cp > 1 and ring.memory.total <= 80 * 10**9
    assert 0 < ring.cost.cp_comm_s < allgather.cost.cp_comm_s
    print(f"[cp plan] llama3-8b 8 H100 ring: {ring.label()} {ring.memory.total / GIB:.1f} GiB, exposed cp "
          f"{ring.cost.cp_comm_s:.3f} s vs all-gather {allgather.cost.cp_comm_s:.3f} s per step")


def test_repeated_kv_gathers_carry_the_query_heads_and_fp32_gradients() -> None:
    """cost_setup.CostSetup.cp_repeated_kv (a published run's software: torch's context_parallel around a model that
    repeats K/V before SDPA): each all-gather moves heads / kv_heads times the bytes, the gradients' reduce-scatter
    fp32; without recomputation that is (1 + 2) x collective_s(4 M) against (1 + 1) x collective_s(M) per layer and
    micro-batch."""
    from dataclasses import replace

    from hpctrain.plan.comm import collective_s, group_link
    from hpctrain.plan.context import cp_kv_message_bytes
    from hpctrain.plan.cost import step_cost
    from hpctrain.plan.cost_setup import CostSetup
    from hpctrain.plan.hardware import resolve_hardware

    job = job_from_dict({"name": "cp", "model": {"preset": "llama3-8b", "seq_len": 65536},
                         "train": {"global_batch": 8, "micro_batch": 1, "activation_checkpointing": "none"},
                         "parallel": {"tp": 1, "pp": 1, "cp": 4},
                         "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100",
                                     "fabric": "ib-ndr400"}})
    model, hw = job.model, resolve_hardware(job)
    base = CostSetup(tp=1, pp=1, dp=8, cp=4, micro_batch=1, micro_batches=4, virtual_stages=1, ac="none", zero=3,
                     offload_optimizer=False, precision="bf16", max_rank_layers=model.layers, max_rank_has_head=True,
                     rank_params=8e9)
    plain = step_cost(model, hw, base, 8).cp_comm_s
    repeated = step_cost(model, hw, replace(base, cp_repeated_kv=True), 8).cp_comm_s
    link = group_link(hw, 1, 4)
    message = cp_kv_message_bytes(model, 1, 4, 1, 2)
    assert model.heads // model.kv_heads == 4
    assert plain == pytest.approx(base.micro_batches * model.layers * 2 * collective_s(4 * message, link, all_reduce=False))
    assert repeated == pytest.approx(base.micro_batches * model.layers * 3 * collective_s(4 * 4 * message, link, all_reduce=False))
    assert repeated > 5 * plain


def test_cp_peers_of_a_pipelined_dense_layout_sit_tp_x_pp_slots_apart() -> None:
    """The placement walks dp x cp as one dimension after tp and pp (plan/placement.py), so with pp > 1 a cp group
    of a dense layout spans tp x pp x cp slots: tp 2 x pp 2 x cp 4 = 16 slots leave an 8-GPU node, and the K/V
    exchange rides the fabric (it was priced as tp apart, inside the node)."""
    from hpctrain.plan.comm import collective_s, group_link
    from hpctrain.plan.context import cp_kv_message_bytes
    from hpctrain.plan.cost import step_cost
    from hpctrain.plan.cost_setup import CostSetup
    from hpctrain.plan.hardware import resolve_hardware

    job = job_from_dict({"name": "cp", "model": {"preset": "llama3-8b", "seq_len": 65536},
                         "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100",
                                     "fabric": "ib-ndr400"}})
    model, hw = job.model, resolve_hardware(job)
    c = CostSetup(tp=2, pp=2, dp=4, cp=4, micro_batch=1, micro_batches=4, virtual_stages=1, ac="none", zero=1,
                  offload_optimizer=False, precision="bf16", max_rank_layers=model.layers // 2, max_rank_has_head=True,
                  rank_params=4e9, sequence_parallel=True)
    link = group_link(hw, 4, 4)
    assert link.nodes == 2 and link.bandwidth_bytes_per_s < group_link(hw, 2, 4).bandwidth_bytes_per_s
    message = cp_kv_message_bytes(model, 1, 4, 2, 2)
    assert step_cost(model, hw, c, 16).cp_comm_s == pytest.approx(
        c.micro_batches * c.max_rank_layers * 2 * collective_s(4 * message, link, all_reduce=False))
