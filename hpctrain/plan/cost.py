"""Step time of a layout: compute, TP / PP / DP communication, pipeline bubble, optimizer.

Physics, not a fit: compute time is FLOPs over an achievable fraction of the GPU's dense peak
(each linear's forward, input-gradient and weight-gradient GEMM slowed by its own reduction width,
attention separately, hardware.py) plus element-wise memory traffic over HBM bandwidth (and, for
a kernel that materialises the attention scores, their traffic); communication is alpha-beta over
hierarchical rings (comm.py: NCCL's latency per ring step, NVLink inside a node, across nodes the NICs of
a collective's members in a node, one NIC for a point-to-point transfer); TP collectives sit on the
critical path, PP sends once per micro-batch and stage, FSDP's gathers and reduce-scatters hide per unit
behind that unit's compute only, slowing it while they run (comm.fsdp_exposed_s); the pipeline bubble is
(p-1)/v micro-batch slots (Narayanan et al. 2021, section 2.2). Every term is a named field of `StepCost`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from hpctrain.plan import comm
from hpctrain.plan.activations import HALF_BYTES, layer_saved_bytes_per_token_no_ac
from hpctrain.plan.comm import FsdpStep, collective_s, fsdp_exposed_s, group_link
from hpctrain.plan.hardware import Hardware
from hpctrain.plan.kernels import (
    DEFAULT_EXPERT_STEP_IMBALANCE,
    FP8_GEMM_EFFICIENCY_RATIO,
    HBM_EFFICIENCY,
    fp8_linears_s,
    gemm_times,
    layer_linears,
    linear_gemm_times,
    moe_ffn_gemm_times,
    routed_fp8_delta_s,
)
from hpctrain.plan.model_stats import (
    attention_core_forward_flops_per_token,
    flops_per_token,
    head_forward_flops_per_token,
    model_flops_per_token,
)

# (GEMM, grouped-GEMM and FP8 kernel times, with their constants: plan/kernels.py.)
# Element-wise traffic in eager PyTorch: each RMSNorm, RoPE, activation and residual add is several
# unfused kernels (RMSNorm alone: upcast, pow, mean, rsqrt, two muls, downcast), each reading and
# writing its tensors, about twice as much again in backward. Counted as passes over the bytes a
# layer saves: ~2.5 passes forward and ~5.5 backward (counted from the runtime model's ops). A count,
# not a fit: the corpus's runs use fused kernels (Megatron, MPT, torchtitan), not hpctrain's eager
# runtime, so none of them can calibrate it.
ELEMENTWISE_PASSES = 8.0
ELEMENTWISE_FORWARD_PASSES = 2.5  # what a recomputed forward re-streams
# Causal attention: flash kernels skip the masked upper triangle, so they execute half of the
# full-matrix FLOPs that flops_per_token counts (the PaLM/Megatron convention); FlashAttention-2
# skips the blocks above the diagonal, about half of them (Dao 2023, arXiv 2307.08691, section 3.1).
CAUSAL_ATTENTION_WORK = 0.5
# A flash kernel's backward recomputes the scores S = QK^T and the probabilities from the saved log-sum-exp
# and then runs four more GEMMs (dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q): five GEMMs of the
# forward's two, so 2.5x the forward's work at the same utilisation (Dao 2023, arXiv 2307.08691, algorithm 2;
# Dao et al. 2022, arXiv 2205.14135, appendix B.4), where the FLOP convention counts backward as 2x.
FLASH_BACKWARD_WORK = 2.5
# Attention kernels before FlashAttention (Megatron-LM's CoreAttention until 2023, fairseq/metaseq,
# DeepSpeed) materialise the [heads, s, s] score matrix: a baddbmm writes it, a fused
# scale-mask-softmax reads and writes it, attention dropout reads it and writes it with a 1-byte
# mask, the probs x V bmm reads it (13 bytes per score element forward in 16-bit), and backward
# reads and writes it again in each of those steps (19 bytes: bmm grad write + probs read, dropout
# grad + mask read and write, softmax grad over the saved output, two reads for dQ and dK). Counted
# from Megatron-LM's core attention (Shoeybi et al. 2019; its scores are Korthikanti et al. 2022's
# 5as/h activation term); recomputation (full, or Korthikanti's selective) replays the forward.
# Its QK^T and AV run as plain batched GEMMs over the whole square, masked half included.
# hpctrain's runtime uses SDPA's flash kernels ("flash"); "materialized" costs a published run that
# used the older kernels (bench/planner_accuracy.py).
ATTENTION_KERNELS = ("flash", "materialized")
SCORE_BYTES_FORWARD = 13.0
SCORE_BYTES_BACKWARD = 19.0
# All-to-alls per MoE block and micro-batch: dispatch and combine forward, their two transposes backward
# (Megatron-Core MoE docs, token dispatcher "alltoall"; torchtitan's expert_parallel.py the same), two more
# when full recomputation replays the forward. Not overlapped: hpctrain's runtime waits for each before
# the expert GEMMs (runtime/parallel/expert.py; Megatron-Core overlaps them only with
# overlap_moe_expert_parallel_comm, off by default). Megatron-Core's MoE guide: an unoverlapped all-to-all
# can take 30-40 % of the step.
A2A_FORWARD = 2
A2A_BACKWARD = 2
# torch.compile (train.compile; the runtime compiles each block with inductor when tp == 1,
# runtime/parallel/compile.py): inductor fuses each chain of element-wise ops between GEMMs (RMSNorm's upcast,
# pow, mean, rsqrt and muls; RoPE; SiLU x gate; residual adds) into one kernel that reads its inputs and writes
# its outputs once, so the ~2.5 forward and ~5.5 backward passes of ELEMENTWISE_PASSES (counted from the eager
# ops) become ~1 forward and ~2 backward (one read + one write per fused region each way; backward reads the
# saved inputs and the gradient and writes the input gradient): a stated saving on the element-wise share.
COMPILED_ELEMENTWISE_PASSES = 3.0
COMPILED_ELEMENTWISE_FORWARD_PASSES = 1.0
# AdamW step + grad-norm: read p, g, m, v and write p, m, v in fp32, plus one read of g for the norm.
OPTIMIZER_BYTES_PER_PARAM = 32.0
# CPU AdamW (offload_optimizer): a DGX A100 has 2 EPYC 7742 with 8 DDR4-3200 channels each, 410 GB/s
# per node (AMD EPYC 7742 datasheet, NVIDIA DGX A100 user guide), 51 GB/s per GPU; torch's unfused
# CPU AdamW is taken to reach ~40 % of that share: an assumption, no offloaded run is in the corpus.
CPU_OPTIMIZER_BYTES_PER_S = 20e9
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


@dataclass(frozen=True)
class CostSetup:
    """Everything about one layout that time depends on."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    micro_batches: int
    virtual_stages: int
    ac: str
    zero: int
    offload_optimizer: bool
    precision: str
    max_rank_layers: int  # layers of the busiest pipeline rank
    max_rank_has_head: bool
    rank_params: float  # parameters of the busiest pipeline rank on one TP rank
    sequence_parallel: bool = False  # norm-region element-wise work split over tp
    # layers of the pipeline rank that holds the head (and loss), when it is another rank: it paces the pipeline
    # instead when its fewer layers and the head take longer (-1: not known, the busiest rank paces)
    head_rank_layers: int = -1
    attention: str = "flash"  # the attention kernel (ATTENTION_KERNELS)
    # Context parallelism (plan/context.py): a rank computes seq_len / cp tokens of each micro-batch, `dp`
    # is then dp x cp (FSDP's group, the ranks sharing the step's tokens), and each layer all-gathers K/V.
    cp: int = 1
    embedding_on_cpu: bool = False  # the lookup on the host: its output and gradient cross PCIe
    cp_rotate: str = "allgather"  # parallel.cp_rotate: ring overlaps its transfers with the blocks' attention
    ep: int = 1  # expert parallelism: routed experts over ep of the dp x tp ranks, tokens by all-to-all
    expert_load_imbalance: float = DEFAULT_EXPERT_STEP_IMBALANCE  # the busiest ep rank's rows over the mean
    fp8: bool = False  # train.precision fp8: eligible linears at the FP8 peak, plus their casts
    fp8_min_width: int = 1024  # train.fp8.min_width
    fp8_recipe: str = "tensorwise"  # train.fp8.recipe (FP8_RECIPES): mxfp8 casts per 32-element block
    compile: bool = False  # train.compile on a layout the runtime compiles (tp == 1)
    # The share of the forward linear GEMMs that ac: selective recomputes: 0 for hpctrain's runtime (its op
    # policy saves every matmul output); a published run's software may differ (bench/planner_accuracy.py).
    selective_mm_recompute: float = 0.0
    # Expert all-to-alls overlapped with another micro-batch's compute (Megatron-Core's moe_a2a_overlap /
    # --overlap-moe-expert-parallel-comm under interleaved 1F1B: one micro-batch's forward beside another's
    # backward, DeepSeek-V3's DualPipe pairing, Liu et al. 2024, arXiv 2412.19437, section 3.2.1). hpctrain's
    # runtime does not overlap them (A2A_FORWARD's note): a published run's software (bench only).
    a2a_overlap: bool = False
    # How the routed copies travel (comm.DEDUP_DISPATCHERS): "alltoall" (NCCL's all-to-all of every copy: hpctrain's
    # runtime, Megatron-Core's alltoall dispatcher, torchtitan) or a node-deduplicating dispatcher ("deepep",
    # "hybridep": Megatron-Core's flex dispatcher): a published run's software (bench only).
    dispatcher: str = "alltoall"
    # FP8 GEMMs for the routed experts too (Transformer Engine's grouped linear under Megatron-Core's fp8): hpctrain's
    # runtime keeps the routed experts in 16 bits (runtime/parallel/float8.py): a published run's software (bench only).
    fp8_experts: bool = False
    # TP collectives overlapped with the GEMMs they feed or follow (Transformer Engine's userbuffers under Megatron-Core's
    # --tp-comm-overlap, torch's AsyncTP; `tp_comm_per_micro_batch_s`): hpctrain's runtime runs them unoverlapped, a
    # published run's software (bench only).
    tp_overlap: bool = False
    # Megatron-Core's data parallelism with its distributed optimizer (zero <= 1): the 16-bit parameters stay
    # replicated, the gradients are reduce-scattered once per step in 16 bits (Megatron-Core's DDP default
    # grad_reduce_in_fp32=False, megatron/core/distributed/distributed_data_parallel_config.py; Megatron-Bridge's
    # performance recipes keep it, perf_recipes/_common.py) during the last micro-batch's backward
    # (overlap_grad_reduce), and the updated shards all-gathered once per step during the first forward
    # (overlap_param_gather). Under zero 2/3 (Megatron-Core's custom FSDP, --data-parallel-sharding-strategy) it
    # gathers and reduces as FSDP does, the gradients still in 16 bits (the same DDP config field). hpctrain's FSDP2
    # gathers every micro-batch and reduces in fp32 (_dp_comm_s): a published run's software (bench only).
    dp_once_per_step: bool = False
    # Context parallelism through torch's context_parallel around a model that repeats K/V to the query heads
    # before SDPA (torchtitan's Llama of 2024-12: `keys = repeat_kv(xk, self.n_rep)` ahead of
    # F.scaled_dot_product_attention in torchtitan/models/llama/model.py): the all-gathered K/V carry `heads`,
    # not `kv_heads`, and their gradients come back in fp32 (torch's _ContextParallelOptions.convert_to_f32,
    # default True). hpctrain's runtime gathers the kv heads in the compute dtype: a published run's software
    # (bench only).
    cp_repeated_kv: bool = False
    # When a MoE block waits for its routing sizes on the host (MOE_SYNCS, MOE_SYNC_HOST_S): "ep" for hpctrain's
    # runtime (the all-to-all's split sizes); a published run's software: "always" (Megatron-Core's dropless MoE),
    # "none" (token dropping padded to capacity; a sync-free MoE under a full-iteration CUDA graph) (bench only).
    moe_sync: str = "ep"
    # Megatron-Core's "moe" recompute module (--recompute-modules moe): under ac selective the whole MoE block's forward
    # (router, dispatch, experts, combine: megatron/core/transformer/moe/moe_layer.py checkpoints its custom_forward)
    # replays in the backward, its all-to-alls included; hpctrain's selective saves the matmul outputs (bench only).
    moe_recompute: bool = False
    # The dense parts of each layer replayed from CUDA graphs (MOE_EAGER_HOST_S): a published run's software (bench
    # only; hpctrain's runtime launches every kernel from the host).
    layer_graphs: bool = False


class StepCost(NamedTuple):
    """One layout's step time and its terms (a named tuple: a search builds one per fitting layout, ~4x faster than
    a frozen dataclass)."""

    step_time_s: float
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_exposed_s: float
    bubble_s: float
    optimizer_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    dp_comm_total_s: float = 0.0  # all of FSDP's collectives, hidden or not
    cp_comm_s: float = 0.0  # of tp_comm_s: context parallelism's K/V exchanges (on the critical path too)
    a2a_s: float = 0.0  # expert parallelism's dispatch/combine all-to-alls (on the critical path, not in tp_comm_s)
    a2a_crosses_nodes: bool = False  # the ep group leaves NVLink (its node, or its NVLink domain): all-to-all over the fabric
    host_s: float = 0.0  # the MoE blocks' host syncs (MOE_SYNC_HOST_S), on the critical path

    @property
    def comm_exposed_s(self) -> float:
        return self.tp_comm_s + self.pp_comm_s + self.dp_comm_exposed_s + self.a2a_s

    @property
    def comm_to_compute(self) -> float:
        """All communication time (TP and PP on the critical path, every FSDP collective hidden or
        not) over the compute that could hide it: above 1 the layout is communication-bound."""
        return (self.tp_comm_s + self.pp_comm_s + self.a2a_s + self.dp_comm_total_s) / self.compute_s if self.compute_s > 0 else 0.0

    @property
    def comm_bound(self) -> bool:
        return self.comm_to_compute > 1.0

    @property
    def comm_share(self) -> float:
        return self.comm_exposed_s / self.step_time_s

    @property
    def bubble_share(self) -> float:
        return self.bubble_s / self.step_time_s


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
        where = _ep_placement(hw, c.tp, c.pp, c.ep, memo)
        top_k = model.moe.top_k
        message = tokens_mb / c.tp * top_k * model.hidden * act_bytes * c.expert_load_imbalance
        if c.dispatcher in comm.DEDUP_DISPATCHERS:
            return comm.all_to_all_s(message, hw, where, comm.dedup_fabric_copies(model.moe.experts, top_k, where),
                                     top_k)
        return comm.all_to_all_s(message, hw, where)

    seconds: float = _memoised(memo, ("a2a", c.tp, c.pp, c.ep, tokens_mb, act_bytes, c.expert_load_imbalance,
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


def layer_time_per_token_s(model: Any, hw: Hardware, tp: int, ac: str, precision: str, sp: bool = False,
                           attention: str = "flash", tokens: float | None = None, ep: int = 1,
                           imbalance: float = DEFAULT_EXPERT_STEP_IMBALANCE, fp8: bool = False,
                           fp8_min_width: int = 1024, compiled: bool = False,
                           selective_mm_recompute: float = 0.0, fp8_experts: bool = False,
                           fp8_recipe: str = "tensorwise", moe_recompute: bool = False) -> float:
    """Forward + backward (+ recompute) time of one layer per token on one TP rank; `tokens` is the
    micro-batch's token count (the weight gradients' K; default one sequence); `selective_mm_recompute` the
    share of the forward linear GEMMs that ac: selective replays (CostSetup)."""
    peak = hw.gpu.rate_flops_per_s(precision)
    gemm_rate = peak * hw.gpu.gemm_efficiency
    attention_rate = peak * hw.gpu.attention_efficiency
    matmul_fwd, matmul_bwd = linear_gemm_times(model, tp, tokens if tokens else model.seq_len, gemm_rate, ep,
                                               imbalance)
    hbm = hw.gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    core_flops = attention_core_forward_flops_per_token(model) / tp
    if attention == "materialized":  # plain GEMMs over the whole square, plus the scores' traffic
        core_fwd = core_flops / gemm_rate
        score_elements = model.heads / tp * model.seq_len  # per token: one row of s scores per head
        scores_fwd = score_elements * SCORE_BYTES_FORWARD / hbm
        scores_bwd = score_elements * SCORE_BYTES_BACKWARD / hbm
    else:
        core_fwd = CAUSAL_ATTENTION_WORK * core_flops / attention_rate
        scores_fwd = scores_bwd = 0.0
    mode = "fp32" if precision == "fp32" else "fsdp-mp"
    # under sequence parallelism the norm / residual regions run on a 1/tp sequence shard
    elementwise_fwd = layer_saved_bytes_per_token_no_ac(model, tp, sp and tp > 1, mode) / hbm
    # the attention core's backward: FLASH_BACKWARD_WORK x its forward's work (flash kernels recompute the scores)
    passes = COMPILED_ELEMENTWISE_PASSES if compiled else ELEMENTWISE_PASSES
    forward_passes = COMPILED_ELEMENTWISE_FORWARD_PASSES if compiled else ELEMENTWISE_FORWARD_PASSES
    fp8_delta = (fp8_linears_s(model, hw, tp, tokens if tokens else model.seq_len, fp8_min_width, compiled, ep,
                               imbalance, fp8_experts=fp8_experts, recipe=fp8_recipe) if fp8 else 0.0)
    core_bwd = (FLASH_BACKWARD_WORK if attention == "flash" else 2.0) * core_fwd
    total = (matmul_fwd + matmul_bwd + fp8_delta + core_fwd + core_bwd + scores_fwd + scores_bwd
             + passes * elementwise_fwd)
    attention_replay = core_fwd + scores_fwd
    if ac == "full":  # the recomputed forward replays the fp8 forward GEMMs too (a third of the delta, counted so)
        total += matmul_fwd + fp8_delta / 3.0 + attention_replay + forward_passes * elementwise_fwd
    elif ac == "selective":  # the runtime's op policy saves matmul/SDPA outputs, recomputes the rest
        total += forward_passes * elementwise_fwd + selective_mm_recompute * (matmul_fwd + fp8_delta / 3.0)
        if moe_recompute and getattr(model, "moe", None) is not None:  # CostSetup.moe_recompute: the MoE FFNs' forward
            from hpctrain.plan.model_stats import moe_layer_count

            mb_tokens = tokens if tokens else model.seq_len
            moe_fwd = moe_ffn_gemm_times(model, tp, mb_tokens, gemm_rate, ep, imbalance)[0]
            if fp8 and fp8_experts:
                moe_fwd += routed_fp8_delta_s(model, hw, tp, mb_tokens, compiled, ep, imbalance, fp8_recipe) / 3.0
            total += (1.0 - selective_mm_recompute) * moe_layer_count(model) / model.layers * moe_fwd
        if attention == "materialized":  # Korthikanti's selective: the attention core is replayed
            total += attention_replay
    return total


def head_time_per_token_s(model: Any, hw: Hardware, tp: int, precision: str) -> float:
    """Head matmul forward + backward and the fp32 loss over the vocabulary, per token."""
    peak = hw.gpu.rate_flops_per_s(precision)
    gemm = 3.0 * head_forward_flops_per_token(model) / tp / (peak * hw.gpu.gemm_efficiency)
    loss_bytes = 8 * 4.0 * model.vocab / tp  # fp32 upcast, log-softmax (max, exp, sum), NLL, grads in/out
    return gemm + loss_bytes / (hw.gpu.hbm_bytes_per_s * HBM_EFFICIENCY)


def forward_share(ac: str) -> float:
    """Forward's share of a layer's compute: the backward pass costs twice the forward (gradients for
    both the inputs and the weights: Narayanan et al. 2021, appendix "Floating-point operations"),
    full recomputation adds one more forward to the backward."""
    return 0.25 if ac == "full" else 1.0 / 3.0


def embedding_transfer_s(model: Any, hw: Hardware, tokens: int, act_bytes: int) -> float:
    """train.embedding_on_cpu, per micro-batch: the lookup's output [tokens, hidden] goes host -> device and
    its gradient device -> host over the host link, one direction each (on the critical path: layer 0
    waits for it, and the embedding's backward for the gradient); the CPU gather itself is not counted."""
    return 2.0 * tokens * model.hidden * act_bytes / hw.gpu.pcie_bytes_per_s


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


def step_cost(model: Any, hw: Hardware, c: CostSetup, global_batch: int,
              memo: dict[Any, Any] | None = None) -> StepCost:
    """Step time and throughput of one layout (see the module docstring for each term). `memo`: one search's store
    of the per-token terms that many of its layouts share (one model, one hardware), keyed by the fields they read."""
    memo = {} if memo is None else memo

    def shared(key: tuple[Any, ...], compute: Any) -> Any:
        return _memoised(memo, key, compute)

    tokens_mb = c.micro_batch * model.seq_len // c.cp
    act_bytes = HALF_BYTES if c.precision != "fp32" else 4
    layer_s = shared(("layer", c.tp, c.ac, c.precision, c.sequence_parallel, c.attention, tokens_mb, c.ep,
                      c.expert_load_imbalance, c.fp8, c.fp8_min_width, c.compile, c.selective_mm_recompute,
                      c.fp8_experts, c.fp8_recipe, c.moe_recompute),
                     lambda: layer_time_per_token_s(model, hw, c.tp, c.ac, c.precision, c.sequence_parallel,
                                                    c.attention, tokens=tokens_mb, ep=c.ep,
                                                    imbalance=c.expert_load_imbalance, fp8=c.fp8,
                                                    fp8_min_width=c.fp8_min_width, compiled=c.compile,
                                                    selective_mm_recompute=c.selective_mm_recompute,
                                                    fp8_experts=c.fp8_experts, fp8_recipe=c.fp8_recipe,
                                                    moe_recompute=c.moe_recompute))
    head_s = shared(("head", c.tp, c.precision), lambda: head_time_per_token_s(model, hw, c.tp, c.precision))
    compute_mb = tokens_mb * (c.max_rank_layers * layer_s + (head_s if c.max_rank_has_head else 0.0))

    # TP: two all-reduces forward and two backward per layer (Shoeybi et al. 2019, figure 4), two
    # more when full recompute re-runs the forward; sequence parallelism swaps each for an
    # all-gather + reduce-scatter pair of the same volume (Korthikanti et al. 2022, section 4.2.2).
    # They sit on the critical path: the next GEMM needs their result.
    tp_mb = tp_comm_per_micro_batch_s(model, hw, c, tokens_mb, act_bytes, memo)

    # PP: one activation forward and one gradient backward per micro-batch and virtual stage,
    # point-to-point between neighbouring stages (one network latency when they sit on two nodes).
    pp_mb = 0.0
    if c.pp > 1:
        pp_link = _link(hw, comm.pp_span(c.tp, c.dp, c.ep), c.pp, memo, collective=False)
        message = tokens_mb * model.hidden * act_bytes / c.tp  # scatter-gather optimisation
        hop = comm.NET_STEP_LATENCY_S if pp_link.nodes > 1 else comm.NVLINK_STEP_LATENCY_S
        pp_mb = 2.0 * c.virtual_stages * (message / pp_link.bandwidth_bytes_per_s + comm.RING_BASE_LATENCY_S + hop)

    # CP: each layer all-gathers K/V forward and reduce-scatters their gradients backward (one more
    # gather when checkpointing recomputes the layer), on the critical path (runtime/parallel/context.py);
    # or, with the ring, only what its transfers take beyond the blocks' attention they overlap.
    cp_mb = 0.0
    if c.cp > 1:
        from hpctrain.plan.context import cp_kv_message_bytes

        # cp peers sit as far apart as dp peers: the placement walks dp x cp as one dimension, cp inside dp
        # (plan/placement.py), so tp x pp slots apart for dense layouts, tp with experts (comm.dp_span)
        cp_link = _link(hw, comm.dp_span(c.tp, c.pp, c.ep), c.cp, memo, collective=c.cp_rotate != "ring")
        message = cp_kv_message_bytes(model, c.micro_batch, c.cp, c.tp, act_bytes)
        if c.cp_rotate == "ring":
            # Point-to-point to the next cp rank, beside one rotation's blocks: a rank's causal attention
            # work split over its cp rotations (runtime/parallel/ring_attention.py); the dK/dV travel in fp32.
            from hpctrain.plan.context import cp_ring_exposed_s

            hop = comm.NET_STEP_LATENCY_S if cp_link.nodes > 1 else comm.NVLINK_STEP_LATENCY_S
            kv_s = message / cp_link.bandwidth_bytes_per_s + comm.RING_BASE_LATENCY_S + hop
            grad_s = message * 4 / act_bytes / cp_link.bandwidth_bytes_per_s + comm.RING_BASE_LATENCY_S + hop
            attention_rate = hw.gpu.rate_flops_per_s(c.precision) * hw.gpu.attention_efficiency
            block_s = (tokens_mb * CAUSAL_ATTENTION_WORK * attention_core_forward_flops_per_token(model) / c.tp
                       / attention_rate / c.cp)
            cp_mb = c.max_rank_layers * cp_ring_exposed_s(c.cp, kv_s, grad_s, block_s, c.ac == "full")
        else:
            gathers = 1 if c.ac == "none" else 2  # forward, and again in the recompute
            grads = 1.0  # the K/V gradients' reduce-scatter, in the compute dtype
            if c.cp_repeated_kv:
                message *= model.heads / model.kv_heads
                grads = 4.0 / act_bytes
            cp_mb = c.max_rank_layers * (gathers + grads) * collective_s(c.cp * message, cp_link, all_reduce=False)
    tp_mb += cp_mb  # reported with the model-parallel communication on the critical path
    a2a_mb = moe_a2a_per_micro_batch_s(model, hw, c, tokens_mb, act_bytes, memo)
    host_mb = moe_sync_host_per_micro_batch_s(model, c)
    if c.pp > 1 and not c.max_rank_has_head and 0 <= c.head_rank_layers and c.max_rank_layers > 0:
        # Every per-layer term above scales with the rank's layers: the head's rank runs head_rank_layers of them
        # and the head and loss; a micro-batch's slot is the slower rank's (the pipeline waits for it).
        share = c.head_rank_layers / c.max_rank_layers
        head_mb = tokens_mb * head_s
        if share * (compute_mb + tp_mb + a2a_mb + host_mb) + head_mb > compute_mb + tp_mb + a2a_mb + host_mb:
            compute_mb, tp_mb, cp_mb, a2a_mb, host_mb = (share * compute_mb + head_mb, share * tp_mb, share * cp_mb,
                                                         share * a2a_mb, share * host_mb)
    slot_s = compute_mb + tp_mb + pp_mb + a2a_mb + host_mb + (embedding_transfer_s(model, hw, tokens_mb, act_bytes)
                                                     if c.embedding_on_cpu else 0.0)
    # Bubble: (p-1)/v micro-batch slots for GPipe, 1F1B and interleaved 1F1B alike (Narayanan et
    # al. 2021, sections 2.2.1-2.2.2; v = 1 but for the interleaved schedule).
    bubble_slots = (c.pp - 1) / c.virtual_stages
    pipeline_s = (c.micro_batches + bubble_slots) * slot_s

    dp_exposed, dp_total = _dp_comm_s(hw, c, compute_mb + tp_mb + a2a_mb + host_mb, memo)
    local_params = c.rank_params / (c.dp if (c.dp > 1 or c.offload_optimizer) else 1)
    if c.offload_optimizer:
        optimizer_s = (OPTIMIZER_BYTES_PER_PARAM * local_params / CPU_OPTIMIZER_BYTES_PER_S
                       + 8.0 * local_params / hw.gpu.pcie_bytes_per_s)
    else:
        optimizer_s = OPTIMIZER_BYTES_PER_PARAM * local_params / hw.gpu.hbm_bytes_per_s

    step = pipeline_s + dp_exposed + optimizer_s
    tokens_per_s = global_batch * model.seq_len / step
    world = c.tp * c.pp * c.dp
    return StepCost(
        step_time_s=step,
        compute_s=c.micro_batches * compute_mb,
        tp_comm_s=c.micro_batches * tp_mb,
        pp_comm_s=c.micro_batches * pp_mb,
        dp_comm_exposed_s=dp_exposed,
        bubble_s=bubble_slots * slot_s,
        optimizer_s=optimizer_s,
        tokens_per_s=tokens_per_s,
        tflops_per_gpu=shared(("flops", c.ac), lambda: flops_per_token(model, c.ac)) * tokens_per_s / world / 1e12,
        mfu=(shared(("model flops",), lambda: model_flops_per_token(model)) * tokens_per_s / world
             / hw.gpu.peak_flops_per_s(c.precision)),
        dp_comm_total_s=dp_total,
        cp_comm_s=c.micro_batches * cp_mb,
        a2a_s=c.micro_batches * a2a_mb,
        a2a_crosses_nodes=c.ep > 1 and _ep_placement(hw, c.tp, c.pp, c.ep, memo).crosses_fabric,
        host_s=c.micro_batches * host_mb,
    )


def _memoised(memo: dict[Any, Any] | None, key: tuple[Any, ...], compute: Any) -> Any:
    """memo[key], computed by `compute()` the first time (every call computes without a memo): step_cost's per-search
    store, one model and one hardware per memo."""
    if memo is None:
        return compute()
    value = memo.get(key)
    if value is None:
        value = memo[key] = compute()
    return value


def _link(hw: Hardware, span: int, ranks: int, memo: dict[Any, Any] | None, collective: bool = True) -> comm.Link:
    """comm.group_link, memoised."""
    link: comm.Link = _memoised(memo, ("link", span, ranks, collective),
                                lambda: group_link(hw, span, ranks, collective))
    return link


def _ep_placement(hw: Hardware, tp: int, pp: int, ep: int, memo: dict[Any, Any] | None) -> Any:
    """comm.ep_placement, memoised."""
    return _memoised(memo, ("ep placement", tp, pp, ep), lambda: comm.ep_placement(hw, tp, pp, ep))


def tp_comm_per_micro_batch_s(model: Any, hw: Hardware, c: CostSetup, tokens_mb: float, act_bytes: int,
                              memo: dict[Any, Any] | None = None) -> float:
    """The busiest rank's tensor-parallel collectives of one micro-batch, on the critical path: per block and pass
    (forward, backward, and the recompute's forward under full AC) one all-reduce (or, under sequence parallelism,
    an all-gather + reduce-scatter pair of the same volume) for the attention and one for the FFN; a MoE block's
    routed experts are not tensor-parallel (each tp rank routes its sequence shard), so its FFN has one only with
    shared experts.

    With `tp_overlap` (a published run's software: Transformer Engine's userbuffer overlap, Megatron-Core's
    --tp-comm-overlap; torch's AsyncTP) each all-gather is split into chunks that feed the column-parallel GEMM
    after it and each reduce-scatter takes the row-parallel GEMM's output chunk by chunk (Wang et al. 2022,
    "Overlap communication with dependent computation via decomposition", ASPLOS'23): a collective shows only
    where it outlasts its GEMM, and costs comm.overlapped_s's SM share where it hides."""
    if c.tp <= 1:
        return 0.0
    from hpctrain.plan.model_stats import moe_layer_count

    link = _link(hw, 1, c.tp, memo)
    message = tokens_mb * model.hidden * act_bytes
    passes = 3 if c.ac == "full" else 2
    moe_share = moe_layer_count(model) / model.layers
    has_shared = False
    if moe_share > 0:  # a dense model never loads the MoE section's module
        from hpctrain.config.moe import shared_width

        has_shared = shared_width(model.moe, int(model.ffn_hidden)) > 0
    ffn_regions = (1 - moe_share) + (moe_share if has_shared else 0.0)
    if not c.tp_overlap:
        return c.max_rank_layers * (1 + ffn_regions) * passes * collective_s(message, link, all_reduce=True)
    rate = (hw.gpu.fp8_rate_flops_per_s * hw.gpu.gemm_efficiency * FP8_GEMM_EFFICIENCY_RATIO if c.fp8
            else hw.gpu.rate_flops_per_s(c.precision) * hw.gpu.gemm_efficiency)
    linears = layer_linears(model, c.tp)

    def gemm_s(group: list[tuple[float, float]]) -> float:
        return gemm_times(group, tokens_mb, rate)[0] * tokens_mb

    half = collective_s(message, link, all_reduce=False)
    hidden = comm.overlap_slowdown(hw.gpu.name) / (1.0 + comm.overlap_slowdown(hw.gpu.name))

    def region(column: float, row: float) -> float:
        return max(half - column, half * hidden) + max(half - row, half * hidden)

    attention = region(gemm_s(linears[:3]), gemm_s(linears[3:4]))
    ffn = region(gemm_s(linears[4:-1]), gemm_s(linears[-1:]))
    return c.max_rank_layers * passes * (attention + ffn_regions * ffn)


def _dp_comm_s(hw: Hardware, c: CostSetup, slot_s: float, memo: dict[Any, Any] | None = None) -> tuple[float, float]:
    """(exposed, total) time of FSDP2's parameter all-gathers (16-bit) and gradient reduce-scatters
    (fp32) over dp, per FSDP unit (one per transformer block) on the busiest rank. When each
    happens follows runtime/parallel/fsdp.py: zero 3 without pipelining gathers again for the
    backward; zero 2/3 without pipelining reduce every micro-batch, zero 0/1 (and every zero under
    pipelining, whose schedule defers it) only in the last one, overlapped with the backward of
    the layers after it; under pipelining the parameters are gathered once per step."""
    if c.dp <= 1 or c.max_rank_layers <= 0:
        return 0.0, 0.0
    link = _link(hw, comm.dp_span(c.tp, c.pp, c.ep), c.dp, memo)
    units = c.max_rank_layers
    unit_params = c.rank_params / units
    compute_bytes = 4 if c.precision == "fp32" else HALF_BYTES
    per_unit = slot_s / units
    forward = per_unit * forward_share(c.ac)
    per_step = c.dp_once_per_step and c.zero <= 1
    return fsdp_exposed_s(FsdpStep(
        units=units,
        gather_s=collective_s(compute_bytes * unit_params, link, all_reduce=False),
        # Megatron-Core reduces gradients in 16 bits at any zero (its DDP config's grad_reduce_in_fp32=False, also
        # read by its custom FSDP): CostSetup.dp_once_per_step's software; FSDP2 (hpctrain) in fp32
        reduce_s=collective_s((compute_bytes if c.dp_once_per_step else 4.0) * unit_params, link, all_reduce=False),
        forward_per_unit_s=forward, backward_per_unit_s=per_unit - forward,
        micro_batches=c.micro_batches,
        gathers_in_backward=c.zero >= 3 and c.pp == 1,
        gather_every_micro_batch=c.pp == 1 and not per_step,
        reduce_every_micro_batch=c.zero >= 2 and c.pp == 1,
        slowdown=comm.overlap_slowdown(hw.gpu.name)))
