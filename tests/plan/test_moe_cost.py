"""The cost of expert parallelism (issue 26 item 2): dispatch/combine all-to-alls over NVLink or the fabric,
grouped-GEMM efficiency of narrow experts, the busiest rank's load imbalance. Torch-free."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.plan import comm
from hpctrain.plan.cost import moe_ffn_gemm_times, step_cost
from hpctrain.plan.cost_setup import CostSetup
from hpctrain.plan.moe_cost import A2A_BACKWARD, A2A_FORWARD, MOE_EAGER_HOST_S, MOE_SYNC_HOST_S
from hpctrain.plan.hardware import resolve_hardware
from hpctrain.plan.search import busiest_rank
from hpctrain.plan.stages import balanced_stage_split


def _hw(nodes: int = 4):
    job = job_from_dict({"name": "h", "model": {"preset": "tiny"},
                         "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100",
                                     "fabric": "ib-ndr400"}})
    return resolve_hardware(job)


def _qwen(**moe):
    base = {"experts": 128, "top_k": 8, "expert_ffn_hidden": 1536}
    return job_from_dict({"name": "q", "model": {"preset": "qwen3-235b-a22b", "seq_len": 4096,
                                                 "moe": {**base, **moe}}}).model


def _cost(model, hw, tp=1, pp=1, dp=32, ep=8, ac="selective", imbalance=1.1, moe_sync="ep", micro_batches=4,
          fp8=False, layer_graphs=False):
    split = balanced_stage_split(model, pp, 1)
    layers, head, params = busiest_rank(model, split, pp, tp, ep)
    return step_cost(model, hw, CostSetup(
        tp=tp, pp=pp, dp=dp, micro_batch=1, micro_batches=micro_batches, virtual_stages=1, ac=ac, zero=1,
        offload_optimizer=False, precision="bf16", max_rank_layers=layers, max_rank_has_head=head,
        rank_params=params, sequence_parallel=tp > 1, ep=ep, expert_load_imbalance=imbalance, moe_sync=moe_sync,
        fp8=fp8, layer_graphs=layer_graphs),
        global_batch=micro_batches * dp)


def test_ep_placement_follows_the_rank_grid():
    hw = _hw()
    assert comm.ep_placement(hw, 1, 1, 8) == comm.EpPlacement(8, 8)
    assert not comm.ep_placement(hw, 1, 1, 8).crosses_nodes
    wide = comm.ep_placement(hw, 1, 1, 16)
    assert wide.crosses_nodes and wide.nodes == 2
    # with experts the pipeline is outermost in the slot order: tp 2 x pp 4 no longer pushes an ep group of 4
    # across nodes (it was one tp group per node before)
    assert comm.ep_placement(hw, 2, 4, 4) == comm.EpPlacement(4, 4)
    assert comm.pp_span(2, 4, ep=4) == 8 and comm.dp_span(2, 4, ep=4) == 2
    assert comm.pp_span(2, 4, ep=1) == 2 and comm.dp_span(2, 4, ep=1) == 8


@pytest.mark.parametrize("tp, pp, dp, ep", [(2, 4, 4, 4), (1, 2, 8, 8), (2, 2, 8, 16), (1, 8, 4, 4)])
def test_the_placement_keeps_each_ep_group_on_as_few_nodes_as_the_cost_model_assumes(tp, pp, dp, ep):
    # The runtime's ep group: ep consecutive ranks of a stage's (dp, tp) grid (runtime/parallel/expert.py).
    from hpctrain.plan.placement import rank_order

    gpus_per_node = 8
    order = rank_order(tp, pp, dp, gpus_per_node, pipeline_outermost=comm.pipeline_outermost(ep))
    world = tp * pp * dp
    slot_of = {rank: slot for slot, rank in enumerate(order or range(world))}
    where = comm.ep_placement(_hw(), tp, pp, ep)
    for stage in range(pp):
        for first in range(0, dp * tp, ep):
            nodes = {slot_of[stage * dp * tp + first + i] // gpus_per_node for i in range(ep)}
            assert len(nodes) == where.nodes, (stage, first, nodes)
    # pipeline neighbours and dp peers sit where the spans say
    assert slot_of[dp * tp] - slot_of[0] == comm.pp_span(tp, dp, ep)
    if dp > 1:
        assert slot_of[tp] - slot_of[0] == comm.dp_span(tp, pp, ep)


def test_all_to_all_inside_a_node_is_the_nvlink_share():
    hw = _hw()
    message = 1e9
    where = comm.EpPlacement(8, 8)
    nvlink = hw.intra_node_bytes_per_s * comm.A2A_NVLINK_EFFICIENCY
    expected = message * 7 / 8 / nvlink + comm.RING_BASE_LATENCY_S + comm.NVLINK_STEP_LATENCY_S
    assert comm.all_to_all_s(message, hw, where) == pytest.approx(expected)
    assert comm.all_to_all_s(message, hw, comm.EpPlacement(1, 1)) == 0.0


def test_all_to_all_across_nodes_is_bounded_by_the_nic():
    hw = _hw()
    message = 1e9
    inside = comm.all_to_all_s(message, hw, comm.EpPlacement(8, 8))
    across = comm.all_to_all_s(message, hw, comm.EpPlacement(16, 8))
    nic = hw.node_fabric_bytes_per_s / hw.gpus_per_node
    # half of the 16 peers sit in the other node: 8/16 of the message over one NIC's share
    assert across == pytest.approx(message * 8 / 16 / nic + comm.RING_BASE_LATENCY_S + comm.NET_STEP_LATENCY_S)
    assert across > 3 * inside  # 45 GB/s of NIC against 360 GB/s of NVLink


def test_a2a_volume_and_count_per_step():
    model, hw = _qwen(), _hw()
    cost = _cost(model, hw, ep=8, imbalance=1.0)
    tokens = 1 * model.seq_len
    message = tokens * model.moe.top_k * model.hidden * 2
    one = comm.all_to_all_s(message, hw, comm.EpPlacement(8, 8))
    assert cost.a2a_s == pytest.approx(4 * model.layers * (A2A_FORWARD + A2A_BACKWARD) * one)
    assert not cost.a2a_crosses_nodes
    assert cost.comm_exposed_s == pytest.approx(cost.tp_comm_s + cost.pp_comm_s + cost.dp_comm_exposed_s
                                                + cost.a2a_s)
    full = _cost(model, hw, ep=8, ac="full", imbalance=1.0)
    assert full.a2a_s == pytest.approx(cost.a2a_s * 6 / 4)  # recomputation replays dispatch and combine


def test_ep_crossing_nodes_costs_more_all_to_all():
    model, hw = _qwen(), _hw()
    inside, across = _cost(model, hw, ep=8), _cost(model, hw, ep=16)
    assert across.a2a_crosses_nodes and not inside.a2a_crosses_nodes
    assert across.a2a_s > 2 * inside.a2a_s
    # (the step itself may still shrink: ep 16 halves the experts each rank gathers and reduces over FSDP)
    assert _cost(model, hw, ep=1).a2a_s == 0.0


def test_load_imbalance_slows_the_busiest_rank():
    model, hw = _qwen(), _hw()
    even, skewed = _cost(model, hw, imbalance=1.0), _cost(model, hw, imbalance=1.3)
    assert skewed.a2a_s == pytest.approx(1.3 * even.a2a_s, rel=0.01)
    assert skewed.compute_s > even.compute_s
    assert skewed.step_time_s > even.step_time_s


def test_narrow_experts_run_slower_per_flop():
    # the same routed FLOPs per token and rows per expert: top-8 of 128 experts of 1536 against top-2 of 32 of 6144
    hw = _hw()
    rate = hw.gpu.bf16_flops_per_s * hw.gpu.gemm_efficiency
    wide = moe_ffn_gemm_times(_qwen(experts=32, top_k=2, expert_ffn_hidden=6144), 1, 4096, rate, ep=1)
    narrow = moe_ffn_gemm_times(_qwen(top_k=8, expert_ffn_hidden=1536), 1, 4096, rate, ep=1)
    assert sum(narrow) > 1.2 * sum(wide)


def test_dense_models_have_no_all_to_all():
    job = job_from_dict({"name": "d", "model": {"preset": "llama3-8b"}})
    hw = _hw(1)
    split = balanced_stage_split(job.model, 1, 1)
    layers, head, params = busiest_rank(job.model, split, 1, 1)
    cost = step_cost(job.model, hw, CostSetup(
        tp=1, pp=1, dp=8, micro_batch=1, micro_batches=1, virtual_stages=1, ac="none", zero=1,
        offload_optimizer=False, precision="bf16", max_rank_layers=layers, max_rank_has_head=head,
        rank_params=params), global_batch=8)
    assert cost.a2a_s == 0.0


def test_each_moe_block_waits_for_its_routing_sizes_on_the_host():
    """moe_cost.MOE_SYNC_HOST_S per MoE block and micro-batch on the busiest rank, on the critical path: hpctrain's
    runtime syncs under ep > 1 only (the all-to-all's split sizes); Megatron-Core's dropless MoE always; a sync-free
    run never. Dense blocks (moe.dense_layers) do not."""
    hw = _hw()
    model = _qwen()  # 94 MoE blocks
    synced = _cost(model, hw, pp=2, dp=16, micro_batches=8)
    free = _cost(model, hw, pp=2, dp=16, micro_batches=8, moe_sync="none")
    busiest = busiest_rank(model, balanced_stage_split(model, 2, 1), 2, 1, 8)[0]
    assert busiest == 48  # the head's rank holds 46
    assert synced.host_s == pytest.approx(8 * 48 * MOE_SYNC_HOST_S, rel=1e-12)
    assert free.host_s == 0.0
    # the pipeline runs micro-batches + (pp - 1) slots: each slot is longer by the rank's syncs (and FSDP's
    # collectives have that much longer to hide behind)
    pipeline = [c.step_time_s - c.dp_comm_exposed_s for c in (synced, free)]
    assert pipeline[0] - pipeline[1] == pytest.approx((8 + 1) * 48 * MOE_SYNC_HOST_S, rel=1e-6)
    assert synced.dp_comm_exposed_s <= free.dp_comm_exposed_s
    assert synced.compute_s == free.compute_s and synced.a2a_s == free.a2a_s
    # ep 1: the runtime's experts need no sizes on the host; Megatron-Core's dropless MoE still reads them
    assert _cost(model, hw, ep=1).host_s == 0.0
    assert _cost(model, hw, ep=1, moe_sync="always").host_s == pytest.approx(4 * 94 * MOE_SYNC_HOST_S, rel=1e-12)
    # only the MoE blocks sync: 4 dense blocks lead the model
    mixed = _qwen(dense_layers=4)
    assert _cost(mixed, hw).host_s == pytest.approx(4 * 90 * MOE_SYNC_HOST_S, rel=1e-12)
    # twice the micro-batches per step: twice the syncs
    assert _cost(model, hw, micro_batches=8).host_s == pytest.approx(2 * _cost(model, hw).host_s, rel=1e-12)


def test_an_fp8_block_without_layer_graphs_also_waits_for_its_eager_launches():
    """moe_cost.MOE_EAGER_HOST_S: after each sync the host launches an FP8 block's dense parts itself (hpctrain's runtime,
    a published run without Transformer Engine's per-layer graphs); with those graphs (layer_graphs) only
    MOE_SYNC_HOST_S is left. A 16-bit block pays the sync alone either way, and a sync-free run nothing."""
    hw = _hw()
    model = _qwen()
    eager = _cost(model, hw, fp8=True)
    graphed = _cost(model, hw, fp8=True, layer_graphs=True)
    assert eager.host_s == pytest.approx(4 * 94 * (MOE_SYNC_HOST_S + MOE_EAGER_HOST_S), rel=1e-12)
    assert graphed.host_s == pytest.approx(4 * 94 * MOE_SYNC_HOST_S, rel=1e-12)
    assert eager.step_time_s - graphed.step_time_s == pytest.approx(4 * 94 * MOE_EAGER_HOST_S, rel=1e-6)
    assert _cost(model, hw).host_s == _cost(model, hw, layer_graphs=True).host_s == graphed.host_s
    assert _cost(model, hw, fp8=True, moe_sync="none").host_s == 0.0


def test_a_dense_model_has_no_host_sync():
    job = job_from_dict({"name": "d", "model": {"preset": "llama3-8b"}})
    hw = _hw(1)
    split = balanced_stage_split(job.model, 1, 1)
    layers, head, params = busiest_rank(job.model, split, 1, 1)
    for sync in ("ep", "always"):
        cost = step_cost(job.model, hw, CostSetup(
            tp=1, pp=1, dp=8, micro_batch=1, micro_batches=2, virtual_stages=1, ac="none", zero=1,
            offload_optimizer=False, precision="bf16", max_rank_layers=layers, max_rank_has_head=head,
            rank_params=params, moe_sync=sync), global_batch=16)
        assert cost.host_s == 0.0


def test_megatrons_moe_recompute_replays_the_moe_blocks_forward_and_its_all_to_alls():
    """CostSetup.moe_recompute (Megatron-Core's "moe" recompute module, beside ac selective): the backward replays each
    MoE block's forward, its routed, shared and router GEMMs and its dispatch and combine, but not attention."""
    hw, model = _hw(), _qwen()
    split = balanced_stage_split(model, 1, 1)
    layers, head, params = busiest_rank(model, split, 1, 1, 8)

    def cost(ac: str, moe_recompute: bool):
        return step_cost(model, hw, CostSetup(
            tp=1, pp=1, dp=32, micro_batch=1, micro_batches=4, virtual_stages=1, ac=ac, zero=1,
            offload_optimizer=False, precision="bf16", max_rank_layers=layers, max_rank_has_head=head,
            rank_params=params, ep=8, moe_recompute=moe_recompute), global_batch=128)

    selective, replayed, full = cost("selective", False), cost("selective", True), cost("full", False)
    rate = hw.gpu.bf16_flops_per_s * hw.gpu.gemm_efficiency
    moe_forward = moe_ffn_gemm_times(model, 1, 4096, rate, 8, 1.1)[0] * 4096  # per micro-batch and block
    assert replayed.compute_s - selective.compute_s == pytest.approx(4 * layers * moe_forward, rel=1e-6)
    # one more dispatch and combine per block, as full recomputation has
    assert replayed.a2a_s == pytest.approx(full.a2a_s, rel=1e-12) and replayed.a2a_s == pytest.approx(
        selective.a2a_s * 6 / 4, rel=1e-12)
    # attention is not replayed: cheaper than full recomputation
    assert selective.compute_s < replayed.compute_s < full.compute_s
    assert cost("none", True).step_time_s == cost("none", False).step_time_s  # only beside selective
