"""A published run's expert dispatch (issue 26 item 2): node-deduplicating dispatchers (DeepEP, HybridEP), the
all-to-alls of Megatron-Core's overlapped 1F1B schedule phase by phase, FP8 routed experts, and the software stack's
efficiencies. Torch-free: exact figures from the formulas."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hpctrain.config import job_from_dict
from hpctrain.plan import comm
from hpctrain.plan.cost import layer_time_per_token_s, routed_fp8_delta_s, step_cost
from hpctrain.plan.cost_setup import CostSetup
from hpctrain.plan.moe_cost import (
    A2A_BACKWARD,
    A2A_FORWARD,
    BlockParts,
    moe_a2a_per_micro_batch_s,
    moe_block_parts,
    one_a2a_s,
    overlapped_a2a_per_block_s,
)
from hpctrain.plan.hardware import FA3_CLASS_ATTENTION_SPEEDUP, resolve_hardware, with_stack
from hpctrain.plan.search import busiest_rank
from hpctrain.plan.stages import balanced_stage_split


def _hw(nodes: int = 32, gpu: str = "h100-80gb"):
    job = job_from_dict({"name": "h", "model": {"preset": "tiny"},
                         "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": gpu,
                                     "node": "dgx-h100" if gpu.startswith("h100") else "dgx-a100",
                                     "fabric": "ib-ndr400"}})
    return resolve_hardware(job)


def _qwen(**model):
    return job_from_dict({"name": "q", "model": {"preset": "qwen3-235b-a22b", "seq_len": 4096, **model}}).model


def _setup(model, tp=2, pp=8, dp=16, ep=32, ac="selective", **kw):
    split = balanced_stage_split(model, pp, 1)
    layers, head, params = busiest_rank(model, split, pp, tp, ep)
    return CostSetup(tp=tp, pp=pp, dp=dp, micro_batch=1, micro_batches=128, virtual_stages=1, ac=ac, zero=1,
                     offload_optimizer=False, precision="bf16", max_rank_layers=layers, max_rank_has_head=head,
                     rank_params=params, sequence_parallel=tp > 1, ep=ep, **kw)


def test_expected_remote_nodes_of_a_token_under_node_deduplication():
    # 8 experts on 2 nodes (4 each), top-2 without replacement: the other node is missed with C(4,2)/C(8,2) = 6/28
    two = comm.EpPlacement(2, 1)
    assert comm.dedup_fabric_copies(8, 2, two) == pytest.approx(1 - 6 / 28)
    # Qwen3-235B's 128 experts over 4 nodes, top-8: 3 x (1 - prod_{i<8} (96 - i) / (128 - i))
    miss = math.prod((96 - i) / (128 - i) for i in range(8))
    assert comm.dedup_fabric_copies(128, 8, comm.EpPlacement(32, 8)) == pytest.approx(3 * (1 - miss))
    assert 2.70 < 3 * (1 - miss) < 2.75  # against 8 x 24/32 = 6 copies over the fabric for NCCL's all-to-all
    assert comm.dedup_fabric_copies(128, 8, comm.EpPlacement(8, 8)) == 0.0  # inside a node: nothing crosses
    # never more copies than the token has: top-1 over 8 nodes reaches at most one remote node
    assert comm.dedup_fabric_copies(64, 1, comm.EpPlacement(64, 8)) == pytest.approx(7 / 8)


def test_a_deduplicating_dispatcher_sends_each_token_once_per_remote_node():
    hw, model = _hw(), _qwen()
    base = _setup(model, expert_load_imbalance=1.0)
    where = comm.ep_placement(hw, 2, 8, 32)
    assert where == comm.EpPlacement(32, 8) and where.crosses_nodes
    message = 4096 / 2 * 8 * 4096 * 2  # tokens / tp x top_k x hidden x bf16
    nic = hw.node_fabric_bytes_per_s / hw.gpus_per_node
    fabric = comm.dedup_fabric_copies(128, 8, where)
    latency = comm.RING_BASE_LATENCY_S + comm.NET_STEP_LATENCY_S
    assert one_a2a_s(model, hw, replace(base, dispatcher="deepep"), 4096, 2) == pytest.approx(
        message / 8 * fabric / nic + latency)
    assert one_a2a_s(model, hw, base, 4096, 2) == pytest.approx(message * 24 / 32 / nic + latency)
    # inside one node both are the same NVLink exchange
    inside = _setup(model, tp=1, pp=1, dp=8, ep=8, expert_load_imbalance=1.0)
    assert one_a2a_s(model, hw, replace(inside, dispatcher="hybridep"), 4096, 2) == one_a2a_s(model, hw, inside, 4096, 2)


def test_overlapped_schedule_hides_each_all_to_all_behind_its_phase_only():
    parts = BlockParts(attention_forward=0.5, attention_backward=3.0, mlp_forward=1.0, mlp_backward=2.0)
    # combine-bwd | attention fwd: 0.5 shows; dispatch fwd+bwd (2) | experts bwd+fwd (3): hidden; combine-fwd | attn bwd
    assert overlapped_a2a_per_block_s(1.0, parts, 0.0) == pytest.approx(0.5)
    # while they overlap, the communication holds s of the SMs: c s / (1 + s) per hidden phase (s = 0.25: 0.2 per c)
    assert overlapped_a2a_per_block_s(1.0, parts, 0.25) == pytest.approx(0.5 + 0.4 + 0.2)
    # nothing to hide behind: all four all-to-alls show
    assert overlapped_a2a_per_block_s(1.0, BlockParts(0, 0, 0, 0), 0.0) == pytest.approx(4.0)


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_block_parts_add_up_to_the_layer_time_of_an_all_moe_model(ac, fp8):
    hw, model = _hw(), _qwen()  # Qwen3-235B: every block is a MoE block
    c = replace(_setup(model, ac=ac, fp8=fp8, fp8_experts=fp8, compile=True), precision="bf16")
    tokens = 4096
    parts = moe_block_parts(model, hw, c, tokens)
    total = parts.attention_forward + parts.attention_backward + parts.mlp_forward + parts.mlp_backward
    layer = layer_time_per_token_s(model, hw, c.tp, ac, "bf16", True, tokens=tokens, ep=c.ep,
                                   imbalance=c.expert_load_imbalance, fp8=fp8, compiled=True, fp8_experts=fp8)
    assert total == pytest.approx(layer * tokens, rel=1e-9)
    assert parts.attention_backward > parts.attention_forward and parts.mlp_backward > parts.mlp_forward


def test_overlap_replaces_the_four_exposed_all_to_alls_of_each_block():
    hw, model = _hw(), _qwen()
    plain = _setup(model)
    overlapped = replace(plain, a2a_overlap=True)
    one = one_a2a_s(model, hw, plain, 4096, 2)
    blocks = plain.max_rank_layers  # every block is MoE
    assert moe_a2a_per_micro_batch_s(model, hw, plain, 4096, 2) == pytest.approx(
        blocks * (A2A_FORWARD + A2A_BACKWARD) * one)
    parts = moe_block_parts(model, hw, plain, 4096)
    assert moe_a2a_per_micro_batch_s(model, hw, overlapped, 4096, 2) == pytest.approx(
        blocks * overlapped_a2a_per_block_s(one, parts, comm.overlap_slowdown(hw.gpu.name)))
    assert step_cost(model, hw, overlapped, 2048).step_time_s < step_cost(model, hw, plain, 2048).step_time_s


def test_fp8_routed_experts_are_faster_grouped_gemms_plus_their_casts():
    hw, model = _hw(), _qwen()
    delta = routed_fp8_delta_s(model, hw, 2, 4096, compiled=True, ep=32, imbalance=1.0)
    assert delta < 0  # 1979 vs 989 TFLOPS dense on the H100 (datasheet), casts included
    # on a GPU without FP8 tensor cores nothing changes
    assert routed_fp8_delta_s(model, _hw(gpu="a100-80gb"), 2, 4096, True, 32, 1.0) == 0.0
    c = _setup(model, fp8=True)
    with_experts = step_cost(model, hw, replace(c, fp8_experts=True), 2048).step_time_s
    assert with_experts < step_cost(model, hw, c, 2048).step_time_s


def test_megatron_te_stack_runs_attention_at_the_fa3_class_on_hopper_only():
    hw = _hw()
    te = with_stack(hw, "megatron-te")
    assert te.gpu.attention_efficiency == pytest.approx(hw.gpu.attention_efficiency * FA3_CLASS_ATTENTION_SPEEDUP)
    assert with_stack(hw, "torch") is hw
    a100 = _hw(gpu="a100-80gb")
    assert with_stack(a100, "megatron-te").gpu == a100.gpu  # no Hopper kernels, no fitted figure: its own
    assert with_stack(hw, "megatron-te", gemm_efficiency=0.66).gpu.gemm_efficiency == 0.66
    with pytest.raises(ValueError, match="unknown software stack"):
        with_stack(hw, "jax")


def test_te_flash_attention_backend_keeps_the_gpus_own_fa2_figure():
    """A Transformer Engine run that disabled cuDNN's fused attention (NVTE_FUSED_ATTN=0, NeMo's launcher of 2024)
    runs flash-attn's FlashAttention-2: the GPU's own attention figure, with the stack's fitted GEMM figure kept."""
    hw = _hw()
    fused, flash = with_stack(hw, "megatron-te"), with_stack(hw, "megatron-te", te_attention="flash")
    assert flash.gpu.attention_efficiency == hw.gpu.attention_efficiency
    assert fused.gpu.attention_efficiency == pytest.approx(1.6 * flash.gpu.attention_efficiency)
    assert flash.gpu.gemm_efficiency == fused.gpu.gemm_efficiency != hw.gpu.gemm_efficiency
    with pytest.raises(ValueError, match="unknown Transformer Engine attention backend"):
        with_stack(hw, "megatron-te", te_attention="cudnn")


def test_nvlink_collectives_inside_an_nvswitch_gen3_node_run_over_nvls():
    """H100-class nodes reduce in the switch (NCCL's NVLS): an in-node collective sees 476 GB/s of bus bandwidth
    (the NCCL maintainer's figure for H100), an A100 node its ring over 0.70 of the line rate."""
    h100 = _hw(nodes=1)
    assert comm.group_link(h100, 1, 8).bandwidth_bytes_per_s == pytest.approx(476e9)
    a100 = _hw(nodes=1, gpu="a100-80gb")
    assert comm.group_link(a100, 1, 8).bandwidth_bytes_per_s == pytest.approx(300e9 * comm.NVLINK_EFFICIENCY)
    # across nodes the fabric bounds it as before
    assert comm.group_link(_hw(nodes=2), 8, 2).bandwidth_bytes_per_s < 476e9
