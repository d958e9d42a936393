"""Time of the kernels a layer's linears run: each GEMM (forward, input gradient, weight gradient) at an
achievable fraction of the GPU's peak, slowed by its own reduction width; the routed experts' grouped GEMMs,
slowed by the expert width too; under FP8 the eligible linears' GEMMs at the FP8 peak plus their casts, which are
streaming kernels over HBM; and the work constants of the kernels between them (eager and compiled element-wise
passes, a causal flash kernel's forward and backward work). plan/cost.py adds these up with attention and
communication into a step.
"""

from __future__ import annotations

from typing import Any

from hpctrain.plan.activations import FP8_TILE, MX_BLOCK
from hpctrain.plan.hardware import Hardware
from hpctrain.plan.model_stats import ffn_matrices, head_dim

HBM_EFFICIENCY = 0.80  # achievable fraction of HBM bandwidth for streaming kernels (STREAM-like copies)
# (HBM_EFFICIENCY: the best streaming kernels reach 88-90 % of the A100's 2.04 TB/s, NVIDIA developer
# forum "Trouble to Reach Peak Bandwidth of A100" and the GTC talk it cites; PyTorch's eager
# element-wise kernels, reading and writing mixed shapes, are taken a step below that: an assumption.)
# A GEMM's efficiency falls with a short reduction dimension K: each output tile runs a main loop
# over K whose prologue and epilogue (loading the first tiles, writing the accumulators) do not
# shrink with it, so a tile is busy K / (K + K0) of its time; cuBLAS's training-shape tiles are
# 128-256 wide and a K of one tile costs about a second's worth (NVIDIA "Matrix Multiplication
# Background" user guide, sections 2.3-2.4 and 3.1: performance grows with K until the main loop
# dominates). Every linear of a layer runs three GEMMs of equal FLOPs (Narayanan et al. 2021,
# appendix): forward (K = its input width), input gradient (K = its output width) and weight
# gradient (K = the micro-batch's tokens), so under TP the sharded widths are K in only some of
# them. K0 = 128 is chosen, not fitted.
GEMM_SIZE_KNEE = 128.0
# (The work constants below were plan/cost.py's until 2026-12-07; it imports them from here.)
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
# torch.compile (train.compile; the runtime compiles each block with inductor when tp == 1,
# runtime/parallel/compile.py): inductor fuses each chain of element-wise ops between GEMMs (RMSNorm's upcast,
# pow, mean, rsqrt and muls; RoPE; SiLU x gate; residual adds) into one kernel that reads its inputs and writes
# its outputs once, so the ~2.5 forward and ~5.5 backward passes of ELEMENTWISE_PASSES (counted from the eager
# ops) become ~1 forward and ~2 backward (one read + one write per fused region each way; backward reads the
# saved inputs and the gradient and writes the input gradient): a stated saving on the element-wise share.
COMPILED_ELEMENTWISE_PASSES = 3.0
COMPILED_ELEMENTWISE_FORWARD_PASSES = 1.0
# Expert parallelism and MoE compute (model.moe; the runtime: runtime/model/moe.py, runtime/parallel/expert.py).
# Grouped GEMM of narrow experts: one torch._grouped_mm over the local experts, each expert's rows a tile
# group of its own, so an expert width w (the N of gate/up, the K of down) of a few tiles wastes the
# partial tiles and the per-group prologue beyond what one wide GEMM does. Stated curve, not fitted:
# efficiency w / (w + GROUPED_GEMM_WIDTH_KNEE) on top of the K factor (GEMM_SIZE_KNEE): 0.75 at Qwen3-235B's
# w = 1536, 0.60 at Qwen3-30B's 768, 0.97 at Mixtral's 14336. Its direction and size follow the published
# grouped-GEMM throughput of one MoE model at falling FFN width (MindSpeed, "Megatron MoE Grouped GEMM",
# table 1: tokens/s 2280, 1780, 1537, 1446 at ffn_hidden 32768, 16384, 8192, 4096): an assumption.
GROUPED_GEMM_WIDTH_KNEE = 512.0
# The busiest ep rank sets the step: its experts receive `imbalance` x the mean rows (all-to-all bytes in
# and expert GEMM rows alike). Megatron-Core's MoE benchmarks force balanced routing for their tables
# (--moe-router-force-load-balancing, Megatron-Core MoE README); trained routers with an auxiliary loss
# stay above it. 1.1 is a stated default (an assumption); CostSetup.expert_load_imbalance takes the
# runtime's measured expert load (max over mean) where a run exists.
DEFAULT_EXPERT_STEP_IMBALANCE = 1.1
# FP8 (train.precision fp8, torchao's Float8Linear, runtime/parallel/float8.py): the eligible linears (both
# full widths >= train.fp8.min_width and multiples of 16; not the head, not the router; the routed experts are
# grouped parameters, not nn.Linear, so they stay 16-bit) run their three GEMMs at the GPU's FP8 peak, each
# with its K factor as in 16 bits, at FP8_GEMM_EFFICIENCY_RATIO x the 16-bit GEMM's fraction of its peak.
# Casts and dynamic scales are memory-bound element-wise work (torchao float8 README, "Performance /
# Derivation": "fp8_overhead_time ... bounded by memory bandwidth"). Per element of a converted linear's input,
# of its output gradient and of its weight (the weight once per micro-batch): an amax read (2 bytes), a cast
# (read 2, write 1) and the second cast into the other GEMM's layout (read 2, write 1; tensorwise re-casts the
# saved 16-bit tensor in backward): 8 bytes, compiled (inductor fuses each amax and cast, torchao's recommended
# setting); eager torchao runs abs, max, scale, clamp and cast as separate kernels, counted as twice that.
# FP8_GEMM_EFFICIENCY_RATIO is FITTED on one source, the calibration source of FP8: the torchao float8 README's
# two H100 linear microbenchmarks (forward + backward of one linear, compiled, tensorwise: M, K, N = 4096,
# 8192, 16384 -> 1.39x over bf16; 1024, 2048, 1024 -> 0.80x). With 8 cast bytes, 0.80 gives 1.35x and 0.80x
# (0.70: 1.20x / 0.75x; 1.00: 1.62x / 0.89x). torchtitan's and the PyTorch blog's end-to-end float8 runs are
# validation rows, never fitted on.
FP8_GEMM_EFFICIENCY_RATIO = 0.80
FP8_CAST_BYTES_COMPILED = 8.0
FP8_CAST_BYTES_EAGER = 16.0
# mxfp8 (train.fp8.recipe, runtime/parallel/mxfp8.py: torchao's MX training GEMM): e4m3 in blocks of MX_BLOCK
# elements along each GEMM's reduction, one E8M0 scale byte per block (OCP MX v1.0), so each of a linear's input,
# weight and output gradient is cast twice, once with blocks along each of its dimensions (forward and weight
# gradient read the input along different axes; torchao mxfp8_linear.py: a dim0 and a dim1 cast of each). Each
# cast is one fused kernel that reads a block, takes its amax and writes it scaled (torchao's triton dim0 and CUDA
# dim1 cast kernels, compiled or not): read 2 bytes, write 1 and 1/32 of a scale byte per element, no separate amax
# pass. Its GEMMs run at the FP8 peak (the block-scaled MMA runs at the FP8 rate: Blackwell architecture technical
# brief) at FP8_GEMM_EFFICIENCY_RATIO of the 16-bit fraction: tensorwise's fitted ratio, an assumption for MX.
# (FP8_TILE and MX_BLOCK, the eligibility tiles: activations.py, beside the memory side's count of the fp8 linears.)
FP8_MX_CAST_BYTES = 2 * (2.0 + 1.0 + 1.0 / MX_BLOCK)
FP8_RECIPES = ("tensorwise", "rowwise", "mxfp8")


def _gemm_size_factor(width: float) -> float:
    return width / (width + GEMM_SIZE_KNEE)


def layer_linears(model: Any, tp: int) -> list[tuple[float, float]]:
    """(input width, output width) of each linear of one layer on one TP rank: column-parallel
    q, k, v and up(/gate) split their outputs, row-parallel o and down their inputs."""
    q = model.heads * head_dim(model) / tp
    kv = model.kv_heads * head_dim(model) / tp
    ffn = model.ffn_hidden / tp
    h = float(model.hidden)
    up = [(h, ffn)] * (ffn_matrices(model) - 1)
    return [(h, q), (h, kv), (h, kv), (q, h)] + up + [(ffn, h)]


def gemm_times(linears: list[tuple[float, float]], tokens: float, rate: float,
                rows: float = 1.0) -> tuple[float, float]:
    """(forward, backward) time per token of `linears`, each run on `rows` rows per token, at `rate`."""
    forward = backward = 0.0
    wgrad = _gemm_size_factor(tokens)
    for fan_in, fan_out in linears:
        flops = 2.0 * fan_in * fan_out * rows
        forward += flops / (rate * _gemm_size_factor(fan_in))
        backward += flops / (rate * _gemm_size_factor(fan_out)) + flops / (rate * wgrad)
    return forward, backward


def linear_gemm_times(model: Any, tp: int, tokens: float, rate: float, ep: int = 1,
                      imbalance: float = DEFAULT_EXPERT_STEP_IMBALANCE) -> tuple[float, float]:
    """(forward, backward) time per token of a layer's linears on one TP rank at `rate` FLOP/s,
    each GEMM slowed by its K (GEMM_SIZE_KNEE): forward K = input width, backward K = output width
    (input gradient) and the micro-batch's tokens (weight gradient). With model.moe the mean over the
    layers of the dense blocks' and the MoE blocks' (`moe_ffn_gemm_times`)."""
    from hpctrain.plan.model_stats import moe_layer_count

    n_moe = moe_layer_count(model)
    if not n_moe:
        return gemm_times(layer_linears(model, tp), tokens, rate)
    dense_f, dense_b = gemm_times(layer_linears(model, tp), tokens, rate)
    attn_f, attn_b = gemm_times(layer_linears(model, tp)[:4], tokens, rate)
    moe_f, moe_b = moe_ffn_gemm_times(model, tp, tokens, rate, ep, imbalance)
    share = n_moe / model.layers
    return ((1 - share) * dense_f + share * (attn_f + moe_f), (1 - share) * dense_b + share * (attn_b + moe_b))


def moe_ffn_gemm_times(model: Any, tp: int, tokens: float, rate: float, ep: int = 1,
                       imbalance: float = DEFAULT_EXPERT_STEP_IMBALANCE) -> tuple[float, float]:
    """(forward, backward) time per micro-batch token of one MoE FFN on the busiest rank: the routed
    experts' grouped GEMMs on top_k routed copies of the rank's token share (1/tp: with tp > 1 each tp rank
    routes its own sequence shard, torchtitan's etp=1; x imbalance under ep), slowed by the expert width
    (GROUPED_GEMM_WIDTH_KNEE) and, in the weight gradient, by the rows one expert gets; the shared experts
    as a dense SwiGLU split over tp; the router [hidden, experts] on the token share."""
    from hpctrain.config.moe import shared_width

    moe, h = model.moe, float(model.hidden)
    share = 1.0 / tp
    forward, backward = routed_gemm_times(model, tp, tokens, rate, ep, imbalance)
    shared = shared_width(moe, int(model.ffn_hidden)) / tp
    extra = ([(h, shared), (h, shared), (shared, h)] if shared else [])
    f, b = gemm_times(extra, tokens, rate)
    rf, rb = gemm_times([(h, float(moe.experts))], tokens * share, rate, rows=share)
    return forward + f + rf, backward + b + rb


def routed_gemm_times(model: Any, tp: int, tokens: float, rate: float, ep: int = 1,
                      imbalance: float = DEFAULT_EXPERT_STEP_IMBALANCE) -> tuple[float, float]:
    """(forward, backward) time per micro-batch token of one MoE block's routed experts on the busiest rank
    (`moe_ffn_gemm_times`' routed part): top_k routed copies of the rank's token share x imbalance under ep, each
    GEMM slowed by the expert width (GROUPED_GEMM_WIDTH_KNEE) and its K, the weight gradient's K the rows one
    local expert gets."""
    from hpctrain.config.moe import expert_width

    moe, h = model.moe, float(model.hidden)
    width = float(expert_width(moe, int(model.ffn_hidden)))
    share = 1.0 / tp
    rows = moe.top_k * share * (imbalance if ep > 1 else 1.0)
    expert_rows = tokens * share * moe.top_k * ep / moe.experts  # rows per local expert (its weight gradient's K)
    grouped = width / (width + GROUPED_GEMM_WIDTH_KNEE)
    forward = backward = 0.0
    for fan_in, fan_out in [(h, width), (h, width), (width, h)]:
        flops = 2.0 * fan_in * fan_out * rows
        forward += flops / (rate * grouped * _gemm_size_factor(fan_in))
        backward += flops / (rate * grouped) * (1.0 / _gemm_size_factor(fan_out) + 1.0 / _gemm_size_factor(expert_rows))
    return forward, backward


def routed_fp8_delta_s(model: Any, hw: Hardware, tp: int, tokens: float, compiled: bool, ep: int = 1,
                       imbalance: float = DEFAULT_EXPERT_STEP_IMBALANCE, recipe: str = "tensorwise") -> float:
    """Per micro-batch token of one MoE block: what FP8 routed experts change (CostSetup.fp8_experts), their grouped
    GEMMs at the FP8 rate minus at the 16-bit rate, plus the casts of what they read: each routed copy's input
    (hidden) and output gradient (hidden), the SwiGLU product and its gradient (width), per element as
    fp8_linears_s's (mxfp8's per block), and every local expert's three weights once per micro-batch."""
    from hpctrain.config.moe import expert_width

    fp8_rate = hw.gpu.fp8_rate_flops_per_s * hw.gpu.gemm_efficiency * FP8_GEMM_EFFICIENCY_RATIO
    if fp8_rate <= 0:
        return 0.0
    bf16_rate = hw.gpu.rate_flops_per_s("bf16") * hw.gpu.gemm_efficiency
    f16, b16 = routed_gemm_times(model, tp, tokens, bf16_rate, ep, imbalance)
    f8, b8 = routed_gemm_times(model, tp, tokens, fp8_rate, ep, imbalance)
    moe, h = model.moe, float(model.hidden)
    width = float(expert_width(moe, int(model.ffn_hidden)))
    rows = moe.top_k / tp * (imbalance if ep > 1 else 1.0)
    cast = (FP8_MX_CAST_BYTES if recipe == "mxfp8" else FP8_CAST_BYTES_COMPILED if compiled
            else FP8_CAST_BYTES_EAGER)
    activations = cast * rows * 2 * (h + width)
    weights = cast * 3 * h * width * (moe.experts / ep) / max(tokens, 1.0)
    return f8 + b8 - f16 - b16 + (activations + weights) / (hw.gpu.hbm_bytes_per_s * HBM_EFFICIENCY)


def fp8_linears_s(model: Any, hw: Hardware, tp: int, tokens: float, min_width: int, compiled: bool,
                  ep: int = 1, imbalance: float = DEFAULT_EXPERT_STEP_IMBALANCE, moe_block_only: bool = False,
                  fp8_experts: bool = False, recipe: str = "tensorwise") -> float:
    """Per token of one layer on one TP rank: what FP8 changes, (fp8 GEMMs + casts) - (16-bit GEMMs), over the
    eligible linears (full widths >= min_width, multiples of FP8_TILE, or of MX_BLOCK x tp for mxfp8, whose
    blocks must stay inside a tp shard; runtime/parallel/float8.py). With model.moe the FFN linears of the MoE
    blocks are the shared experts' only (the routed ones stay 16-bit), unless `fp8_experts` (a published run's
    software: `routed_fp8_delta_s`); `moe_block_only`: one MoE block's attention linears and shared experts, not
    the mean layer."""
    from hpctrain.plan.model_stats import moe_layer_count

    bf16_rate = hw.gpu.rate_flops_per_s("bf16") * hw.gpu.gemm_efficiency
    fp8_rate = hw.gpu.fp8_rate_flops_per_s * hw.gpu.gemm_efficiency * FP8_GEMM_EFFICIENCY_RATIO
    if fp8_rate <= 0:
        return 0.0
    hbm = hw.gpu.hbm_bytes_per_s * HBM_EFFICIENCY
    mx = recipe == "mxfp8"
    cast = FP8_MX_CAST_BYTES if mx else FP8_CAST_BYTES_COMPILED if compiled else FP8_CAST_BYTES_EAGER
    tile = MX_BLOCK * tp if mx else FP8_TILE

    def delta(full: list[tuple[float, float]], local: list[tuple[float, float]]) -> float:
        keep = [(i, o) for (fi, fo), (i, o) in zip(full, local)
                if min(fi, fo) >= min_width and fi % tile == 0 and fo % tile == 0]
        if not keep:
            return 0.0
        f16, b16 = gemm_times(keep, tokens, bf16_rate)
        f8, b8 = gemm_times(keep, tokens, fp8_rate)
        casts = sum(cast * (i + o) + cast * i * o / max(tokens, 1.0) for i, o in keep) / hbm
        return f8 + b8 + casts - f16 - b16

    dense = delta(layer_linears(model, 1), layer_linears(model, tp))
    n_moe = moe_layer_count(model)
    if not n_moe:
        return dense
    from hpctrain.config.moe import shared_width

    h = float(model.hidden)
    sw = float(shared_width(model.moe, int(model.ffn_hidden)))
    shared_full = [(h, sw), (h, sw), (sw, h)] if sw else []
    shared_local = [(h, sw / tp), (h, sw / tp), (sw / tp, h)] if sw else []
    moe_block = delta(layer_linears(model, 1)[:4] + shared_full, layer_linears(model, tp)[:4] + shared_local)
    if moe_block_only:
        return moe_block
    if fp8_experts:
        moe_block += routed_fp8_delta_s(model, hw, tp, tokens, compiled, ep, imbalance, recipe)
    share = n_moe / model.layers
    return (1 - share) * dense + share * moe_block
