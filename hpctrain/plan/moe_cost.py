"""The expert-parallel terms of a step (model.moe with parallel.ep): the dispatch and combine all-to-alls, hidden
behind another micro-batch's compute where the software overlaps them, and the host's syncs on each block's routing
sizes. plan/cost.py adds them into a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.plan import comm
from hpctrain.plan.cost_setup import CostSetup, memoised
from hpctrain.plan.hardware import Hardware
from hpctrain.plan.kernels import (
    CAUSAL_ATTENTION_WORK,
    COMPILED_ELEMENTWISE_FORWARD_PASSES,
    COMPILED_ELEMENTWISE_PASSES,
    ELEMENTWISE_FORWARD_PASSES,
    ELEMENTWISE_PASSES,
    FLASH_BACKWARD_WORK,
    HBM_EFFICIENCY,
    fp8_linears_s,
    gemm_times,
    layer_linears,
    moe_ffn_gemm_times,
    routed_fp8_delta_s,
)
from hpctrain.plan.model_stats import attention_core_forward_flops_per_token

# All-to-alls per MoE block and micro-batch: dispatch and combine forward, their two transposes backward
# (Megatron-Core MoE docs, token dispatcher "alltoall"; torchtitan's expert_parallel.py the same), two more
# when full recomputation replays the forward. Not overlapped: hpctrain's runtime waits for each before
# the expert GEMMs (runtime/parallel/expert.py; Megatron-Core overlaps them only with
# overlap_moe_expert_parallel_comm, off by default). Megatron-Core's MoE guide: an unoverlapped all-to-all
# can take 30-40 % of the step.
A2A_FORWARD = 2
A2A_BACKWARD = 2
# A dropless MoE block's host sync. The host must know how many rows each rank or expert gets before it can launch
# the block's next kernels: hpctrain's runtime reads the all-to-all's split sizes (runtime/parallel/expert.py,
# `.tolist()`) under ep > 1; Megatron-Core's dropless MoE reads the tokens per expert at any ep. Each such read
# drains the GPU's queue, so the host's time to launch the block (Python, PyTorch's dispatch, CUDA launches) stops
# hiding behind queued GPU work, and no CUDA graph can cover the routed experts (Megatron-LM, "Optimizing
# DeepSeek-V3 Training Performance on NVIDIA GB200 NVL72", docs/discussions/deepseek-v3-gb200-optimization,
# commit eb0783b6d3, sections 2 and 2.3). MOE_SYNC_HOST_S is that exposed host time per MoE block and micro-batch,
# forward and backward, derived from the same guide's section 3.1: removing the sync (so that CUDA graphs cover the
# whole model) is estimated at "at least a 10% additional performance gain" on its final configuration, DeepSeek-V3
# at 970 TFLOP/s per GPU on 256 GB200 (TP 1, PP 8, VPP 4, EP 32, MBS 1, GBS 2048, seq 4096). That step is
# 2048 x 4096 tokens x 2.61e11 FLOP (6 x 38.2 B active matmul parameters with the MTP layer and both heads, plus
# causal MLA attention) / (256 x 970e12 FLOP/s) = 8.8 s, of which >= 1 - 1/1.1 = 9.1 % (0.80 s) is this host time,
# over 64 micro-batches x 59 / 8 MoE blocks per rank (58 MoE layers and the MTP layer): 1.7 ms. A lower bound, on
# Grace hosts with NUMA binding; taken for every host. A run without the sync (token dropping padded to capacity, or
# a sync-free MoE under a full-iteration CUDA graph: a published run's software) has none (MOE_SYNCS "none").
MOE_SYNC_HOST_S = 1.7e-3
MOE_SYNCS = ("ep", "always", "none")  # when a MoE block syncs: under ep > 1 (hpctrain's runtime), always, never
# MOE_SYNC_HOST_S is the exposed host time of a block whose dense parts replay from CUDA graphs, as the guide's runs
# did (Transformer Engine's per-layer graphs of attention, router and token preprocessing: Megatron-Core's
# cuda_graph_impl transformer_engine, cuda_graph_scope attn moe_router moe_preprocess). Launched eagerly, those parts
# add their launches to what the host must issue after each sync: the same guide's section 3 table measures turning
# the graphs on at 610.71 -> 663.27 TFLOP/s per GPU, 14.01 -> 12.90 s of its 2048 x 4096-token step (2.19e18 FLOP
# over 256 GPUs), 1.11 s over 64 micro-batches x 59 / 8 MoE blocks per rank: MOE_EAGER_HOST_S, 2.35 ms more per MoE
# block and micro-batch without them (CostSetup.layer_graphs False: hpctrain's runtime, which captures no graphs, and
# a published run without them). That run trained in MXFP8, whose every linear adds quantisation kernels and their
# host-side allocations, which is why the guide calls CPU overhead "a major performance issue in FP8 training"
# (section 2.4; section 2, "FP8 training and fine-grained MoE models introduce more quantization, router, and other
# kernels"): the extra is charged to FP8 runs only; a 16-bit run's dense parts are taken to launch few enough kernels
# to stay ahead of the GPU (an assumption, as is taking Grace's figure for every host, and charging compiled blocks
# alike, whose fused casts launch fewer kernels; the guide measured it before its NUMA binding, section 2.4, so it is
# an upper figure for a bound host).
MOE_EAGER_HOST_S = 2.35e-3


def moe_a2a_per_micro_batch_s(model: Any, hw: Hardware, c: CostSetup, tokens_mb: float, act_bytes: int,
                              memo: dict[Any, Any] | None = None) -> float:
    """The busiest rank's dispatch/combine all-to-alls of one micro-batch over its MoE blocks: each moves
    the rank's top_k routed copies of its token share (tokens / tp under tp's sequence sharding) x hidden,
    x imbalance (the busiest rank receives that much more), (ep-1)/ep of it off the rank (comm.all_to_all_s)."""
    if c.ep <= 1 or getattr(model, "moe", None) is None:
        return 0.0
    moe_layers = rank_moe_blocks(model, c)
    one = one_a2a_s(model, hw, c, tokens_mb, act_bytes, memo)
    if c.a2a_overlap:
        return moe_layers * overlapped_a2a_per_block_s(one, moe_block_parts(model, hw, c, tokens_mb),
                                                       comm.overlap_slowdown(hw.gpu.name))
    replayed = c.ac == "full" or (c.ac == "selective" and c.moe_recompute)
    count = A2A_FORWARD + A2A_BACKWARD + (A2A_FORWARD if replayed else 0)
    return moe_layers * count * one


def one_a2a_s(model: Any, hw: Hardware, c: CostSetup, tokens_mb: float, act_bytes: int,
              memo: dict[Any, Any] | None = None) -> float:
    """One dispatch (or combine) of one MoE block and micro-batch on the busiest rank: its top_k routed copies of
    the rank's token share (tokens / tp under tp's sequence sharding) x hidden x imbalance (the busiest rank
    receives that much more), over the ep group (comm.all_to_all_s), deduplicated per node by a DEDUP_DISPATCHER."""
    def compute() -> float:
        where = ep_placement(hw, c.tp, c.pp, c.ep, memo)
        top_k = model.moe.top_k
        message = tokens_mb / c.tp * top_k * model.hidden * act_bytes * c.expert_load_imbalance
        if c.dispatcher in comm.DEDUP_DISPATCHERS:
            return comm.all_to_all_s(message, hw, where, comm.dedup_fabric_copies(model.moe.experts, top_k, where),
                                     top_k)
        return comm.all_to_all_s(message, hw, where)

    seconds: float = memoised(memo, ("a2a", c.tp, c.pp, c.ep, tokens_mb, act_bytes, c.expert_load_imbalance,
                                     c.dispatcher), compute)
    return seconds


@dataclass(frozen=True)
class BlockParts:
    """One MoE block's compute for one micro-batch on one TP rank, in the sub-modules Megatron-Core's overlapped
    1F1B schedule pairs with the all-to-alls (`overlapped_a2a_per_block_s`): the pre-dispatch part (norms,
    attention, router) and the experts (routed and shared), forward and backward (with what recomputation
    replays in the backward)."""

    attention_forward: float
    attention_backward: float
    mlp_forward: float
    mlp_backward: float


def moe_block_parts(model: Any, hw: Hardware, c: CostSetup, tokens_mb: float) -> BlockParts:
    """`BlockParts` of one MoE block from the terms layer_time_per_token_s adds up: the attention linears, the core
    attention and the norm-side element-wise passes before the dispatch; the expert GEMMs (moe_ffn_gemm_times) and
    the routed copies' element-wise passes after it; FP8 changes each side's GEMMs (fp8_linears_s' eligible
    attention linears and shared experts, `routed_fp8_delta_s` with fp8_experts)."""
    from hpctrain.plan.activations import moe_attention_side_saved_bytes_per_token

    precision = c.precision
    peak = hw.gpu.rate_flops_per_s(precision)
    gemm_rate = peak * hw.gpu.gemm_efficiency
    attention_rate = peak * hw.gpu.attention_efficiency
    hbm = hw.gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    attn_f, attn_b = gemm_times(layer_linears(model, c.tp)[:4], tokens_mb, gemm_rate)
    mlp_f, mlp_b = moe_ffn_gemm_times(model, c.tp, tokens_mb, gemm_rate, c.ep, c.expert_load_imbalance)
    core_f = CAUSAL_ATTENTION_WORK * attention_core_forward_flops_per_token(model) / c.tp / attention_rate
    mode = "fp32" if precision == "fp32" else "fsdp-mp"
    sp = c.sequence_parallel and c.tp > 1
    total_bytes = moe_block_saved_bytes_per_token(model, c.tp, sp, mode)
    attn_bytes = moe_attention_side_saved_bytes_per_token(model, c.tp, sp, mode)
    passes = COMPILED_ELEMENTWISE_PASSES if c.compile else ELEMENTWISE_PASSES
    forward_passes = COMPILED_ELEMENTWISE_FORWARD_PASSES if c.compile else ELEMENTWISE_FORWARD_PASSES
    ew_attn, ew_mlp = attn_bytes / hbm, (total_bytes - attn_bytes) / hbm
    a_f = attn_f + core_f + forward_passes * ew_attn
    a_b = attn_b + FLASH_BACKWARD_WORK * core_f + (passes - forward_passes) * ew_attn
    m_f = mlp_f + forward_passes * ew_mlp
    m_b = mlp_b + (passes - forward_passes) * ew_mlp
    dense_delta = routed = 0.0
    if c.fp8:  # the delta splits 1:2 between forward and backward GEMMs, as layer_time_per_token_s counts it
        dense_delta = fp8_linears_s(model, hw, c.tp, tokens_mb, c.fp8_min_width, c.compile, c.ep,
                                    c.expert_load_imbalance, moe_block_only=True, recipe=c.fp8_recipe)
        routed = (routed_fp8_delta_s(model, hw, c.tp, tokens_mb, c.compile, c.ep, c.expert_load_imbalance,
                                     c.fp8_recipe) if c.fp8_experts else 0.0)
        a_f, a_b = a_f + dense_delta / 3.0, a_b + 2.0 * dense_delta / 3.0
        m_f, m_b = m_f + routed / 3.0, m_b + 2.0 * routed / 3.0
    if c.ac == "full":
        a_b, m_b = a_b + a_f, m_b + m_f
    elif c.ac == "selective":
        a_b += forward_passes * ew_attn + c.selective_mm_recompute * (attn_f + dense_delta / 3.0)
        m_b += forward_passes * ew_mlp + (1.0 if c.moe_recompute else c.selective_mm_recompute) * (mlp_f + routed / 3.0)
    return BlockParts(a_f * tokens_mb, a_b * tokens_mb, m_f * tokens_mb, m_b * tokens_mb)


def moe_block_saved_bytes_per_token(model: Any, tp: int, sp: bool, mode: str) -> float:
    """What one MoE block (not the mean layer) saves per token without checkpointing (activations.py)."""
    from hpctrain.plan.activations import moe_block_saved_bytes_per_token_no_ac

    return moe_block_saved_bytes_per_token_no_ac(model, tp, sp, mode)


def overlapped_a2a_per_block_s(one: float, parts: BlockParts, slowdown: float) -> float:
    """Exposed all-to-all time of one MoE block per micro-batch under Megatron-Core's overlapped 1F1B schedule
    (--overlap-moe-expert-parallel-comm; megatron/core/models/common/model_chunk_schedule_plan.py,
    TransformerLayerSchedulePlan.run): one micro-batch's forward of a layer runs beside another's backward of a
    layer in three phases, communication stream against compute stream:
        combine backward              | pre-dispatch forward (norm, attention, router)
        dispatch forward + backward   | experts backward (dgrad, wgrad) + experts forward
        combine forward               | pre-dispatch backward
    so each a2a hides only behind the compute of its phase; while they overlap, the communication kernels hold
    `slowdown` of the SMs (comm.overlapped_s's rule: a phase costs max(c - w, c s / (1 + s)) beyond its compute)."""
    hidden = slowdown / (1.0 + slowdown)
    phases = ((one, parts.attention_forward), (2.0 * one, parts.mlp_backward + parts.mlp_forward),
              (one, parts.attention_backward))
    return sum(max(c - w, c * hidden) for c, w in phases)


def rank_moe_blocks(model: Any, c: CostSetup) -> float:
    """The busiest rank's MoE blocks: its layers' share of them (dense_layers lead the model, counted as spread over
    the ranks)."""
    from hpctrain.plan.model_stats import moe_layer_count

    return c.max_rank_layers * moe_layer_count(model) / model.layers


def moe_sync_host_per_micro_batch_s(model: Any, c: CostSetup) -> float:
    """The busiest rank's MoE blocks' host syncs in one micro-batch, forward and backward (MOE_SYNC_HOST_S, and
    MOE_EAGER_HOST_S more per block whose dense parts the host launches itself)."""
    if c.moe_sync == "none" or (c.moe_sync == "ep" and c.ep <= 1) or getattr(model, "moe", None) is None:
        return 0.0
    return rank_moe_blocks(model, c) * (MOE_SYNC_HOST_S + (MOE_EAGER_HOST_S if c.fp8 and not c.layer_graphs else 0.0))


def ep_placement(hw: Hardware, tp: int, pp: int, ep: int, memo: dict[Any, Any] | None) -> Any:
    """comm.ep_placement, memoised."""
    return memoised(memo, ("ep placement", tp, pp, ep), lambda: comm.ep_placement(hw, tp, pp, ep))
