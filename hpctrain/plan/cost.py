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

from typing import Any

from hpctrain.plan import comm
from hpctrain.plan.activations import HALF_BYTES, layer_saved_bytes_per_token_no_ac
from hpctrain.plan.comm import FsdpStep, collective_s, fsdp_exposed_s, group_link
from hpctrain.plan.cost_setup import CostSetup, StepCost, memoised
from hpctrain.plan.hardware import Hardware
from hpctrain.plan.kernels import (
    CAUSAL_ATTENTION_WORK,
    COMPILED_ELEMENTWISE_FORWARD_PASSES,
    COMPILED_ELEMENTWISE_PASSES,
    DEFAULT_EXPERT_STEP_IMBALANCE,
    ELEMENTWISE_FORWARD_PASSES,
    ELEMENTWISE_PASSES,
    FLASH_BACKWARD_WORK,
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
from hpctrain.plan.moe_cost import ep_placement, moe_a2a_per_micro_batch_s, moe_sync_host_per_micro_batch_s

# (GEMM, grouped-GEMM and FP8 kernel times, element-wise passes and flash attention's work, with their constants:
# plan/kernels.py; the expert-parallel terms: plan/moe_cost.py; CostSetup and StepCost: plan/cost_setup.py.)
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
# AdamW step + grad-norm: read p, g, m, v and write p, m, v in fp32, plus one read of g for the norm.
OPTIMIZER_BYTES_PER_PARAM = 32.0
# CPU AdamW (offload_optimizer): a DGX A100 has 2 EPYC 7742 with 8 DDR4-3200 channels each, 410 GB/s
# per node (AMD EPYC 7742 datasheet, NVIDIA DGX A100 user guide), 51 GB/s per GPU; torch's unfused
# CPU AdamW is taken to reach ~40 % of that share: an assumption, no offloaded run is in the corpus.
CPU_OPTIMIZER_BYTES_PER_S = 20e9


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


def step_cost(model: Any, hw: Hardware, c: CostSetup, global_batch: int,
              memo: dict[Any, Any] | None = None) -> StepCost:
    """Step time and throughput of one layout (see the module docstring for each term). `memo`: one search's store
    of the per-token terms that many of its layouts share (one model, one hardware), keyed by the fields they read."""
    memo = {} if memo is None else memo

    def shared(key: tuple[Any, ...], compute: Any) -> Any:
        return memoised(memo, key, compute)

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
        a2a_crosses_nodes=c.ep > 1 and ep_placement(hw, c.tp, c.pp, c.ep, memo).crosses_fabric,
        host_s=c.micro_batches * host_mb,
    )


def _link(hw: Hardware, span: int, ranks: int, memo: dict[Any, Any] | None, collective: bool = True) -> comm.Link:
    """comm.group_link, memoised."""
    link: comm.Link = memoised(memo, ("link", span, ranks, collective),
                               lambda: group_link(hw, span, ranks, collective))
    return link


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
