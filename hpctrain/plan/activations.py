"""Activation memory of the runtime's model: bytes saved for backward per token and per layer.

Method: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4 — add up every tensor a layer's forward saves for its backward. The tensors counted
here are those of hpctrain/runtime/model/transformer.py (pre-norm RMSNorm, RoPE, GQA with an explicit
repeat, scaled_dot_product_attention with its flash backends, gelu or swiglu FFN), traced with
torch.autograd.graph.saved_tensors_hooks and checked against MemTracker (tests/plan/
test_memory_truth.py). Unlike Korthikanti's GPT, there is no dropout and attention keeps no
seq x seq matrix (flash attention saves its output and the log-sum-exp instead).

Precision modes (how the runtime casts, see hpctrain/runtime/parallel/precision.py, parallel/fsdp.py):
- "fp32": everything fp32.
- "autocast": fp32 parameters; the model casts the residual stream to 16 bits after the
  embedding, so every activation is 16-bit; autocast casts each weight to 16 bits and each
  linear saves its cast weight.
- "fsdp-mp": FSDP2's MixedPrecisionPolicy holds 16-bit unsharded parameters, so the whole
  forward is 16-bit.
In every mode RMSNorm (runtime/model/norm.py) saves its input as it came and one fp32 rstd per token,
as a fused kernel does; under sequence parallelism the inputs of attention and the FFN are kept
as sequence shards and gathered again in backward (runtime/parallel/sequence.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hpctrain.plan.model_stats import attention_params, dense_ffn_params, ffn_params, head_dim

FP32_BYTES = 4
HALF_BYTES = 2
INDEX_BYTES = 8  # int64 token ids saved by the embedding for its backward


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of the tensors a layer saves, for one precision mode."""

    stream: int  # the residual stream (block inputs/outputs, what checkpointing keeps)
    norm_out: int  # RMSNorm's output (the linears' input unless autocast casts it)
    matmul: int  # matmul outputs, attention tensors, FFN intermediates
    casts_inputs: bool  # autocast: each linear saves its own 16-bit copy of its input
    casts_weights: bool  # autocast: each linear saves a 16-bit copy of its weight


# One instance per mode (the planner asks for them ~100,000 times per search).
_DTYPES = {"fp32": Dtypes(FP32_BYTES, FP32_BYTES, FP32_BYTES, False, False),
           "autocast": Dtypes(HALF_BYTES, HALF_BYTES, HALF_BYTES, False, True),
           "fsdp-mp": Dtypes(HALF_BYTES, HALF_BYTES, HALF_BYTES, False, False)}


def precision_mode(precision: str, fsdp: bool) -> str:
    """The runtime's casting mode for a precision and whether FSDP2 wraps the model."""
    if precision == "fp32":
        return "fp32"
    return "fsdp-mp" if fsdp else "autocast"


def dtypes(mode: str) -> Dtypes:
    try:
        return _DTYPES[mode]
    except KeyError:
        raise ValueError(f"unknown precision mode {mode!r}") from None


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one layer keeps for its backward, for one micro-batch, on one TP rank."""

    saved_bytes: float  # held from the layer's forward until its backward
    recompute_peak_bytes: float  # extra, briefly, while the layer's backward recomputes (AC)


def _widths(model: Any, tp: int, ffn: float | None = None) -> tuple[float, float, float, float, float]:
    """Per-TP-rank widths: hidden, query width, k/v width after GQA repeat, kv width, ffn width
    (`ffn`: a dense FFN of another width, e.g. a MoE block's shared experts)."""
    hidden = float(model.hidden)
    q_width = model.heads * head_dim(model) / tp
    kv_width = model.kv_heads * head_dim(model) / tp
    repeated = q_width if model.heads != model.kv_heads else kv_width
    return hidden, q_width, repeated, kv_width, (model.ffn_hidden if ffn is None else ffn) / tp


@dataclass(frozen=True)
class MoeShape:
    """A MoE block's FFN (runtime/model/moe.py): routed experts, top-k, expert width, shared width."""

    experts: int
    top_k: int
    width: int
    shared: int
    moe_layers: int
    layers: int

    @property
    def dense_share(self) -> float:
        return (self.layers - self.moe_layers) / self.layers


def moe_shape(model: Any) -> MoeShape | None:
    moe = getattr(model, "moe", None)
    if moe is None:  # a dense model never loads the MoE section's module (config/lazy.py builds it on first use)
        return None
    from hpctrain.config.moe import expert_width, shared_width
    from hpctrain.plan.model_stats import moe_layer_count

    ffn = int(model.ffn_hidden)
    return MoeShape(int(moe.experts), int(moe.top_k), expert_width(moe, ffn), shared_width(moe, ffn),
                    moe_layer_count(model), int(model.layers))


def _over_layers(model: Any, dense: float, moe: float, shape: MoeShape | None) -> float:
    """A per-layer figure as the mean over the model's layers (dense and MoE blocks): layers x it is the sum."""
    return dense if shape is None else shape.dense_share * dense + (1 - shape.dense_share) * moe


# Expert parallelism's load: the rows a rank's local experts receive, over the mean (tokens x top_k per rank).
# 1.0 is a balanced router, what bench/memory_accuracy.py checks against MemTracker (its runs route what
# they route: a randomly initialised router on random tokens lands within a few percent of the mean);
# a job that expects a skewed router passes its own factor (RankSetup.expert_load_imbalance).
DEFAULT_EXPERT_LOAD_IMBALANCE = 1.0


@dataclass(frozen=True)
class ExpertRouting:
    """How a rank's MoE blocks see their tokens: `ep` ranks exchanging them, the load of this rank's experts
    (received rows / mean) and the share of the micro-batch's tokens the block routes on this rank (1/tp
    under sequence parallelism: with ep over tp ranks each routes its own sequence shard, torchtitan's etp=1)."""

    ep: int = 1
    imbalance: float = DEFAULT_EXPERT_LOAD_IMBALANCE
    token_share: float = 1.0

    @property
    def received(self) -> float:
        """Rows the local experts compute, per routed copy of a token of this rank's share."""
        return 1.0 if self.ep == 1 else self.imbalance


def expert_routing(tp: int, sp: bool, ep: int = 1, imbalance: float = DEFAULT_EXPERT_LOAD_IMBALANCE) -> ExpertRouting:
    return ExpertRouting(ep, imbalance, 1.0 / tp if (ep > 1 and sp and tp > 1) else 1.0)


def moe_routing_bytes_per_token(shape: MoeShape, model: Any, d: Dtypes, routing: ExpertRouting | None = None) -> float:
    """What a MoE FFN saves per token beyond a dense FFN of the shared width, traced with
    saved_tensors_hooks on runtime/model/moe.py: the routed copies' SwiGLU intermediates (w1 and w3
    outputs, silu, product: 4 x top_k x width), the gathered inputs, the routed outputs and their
    weighted copy (3 x top_k x hidden), the router's fp32 scores [experts], its top-k ids (int64) and
    weights, the sort order and token index of every slot (int64 each), and the router's fp32 copy
    of its input when the stream is 16-bit (the router computes in fp32).

    Under expert parallelism (runtime/parallel/expert.py's run_experts) the gathered rows go out by
    all-to-all (which saves nothing) and the rows that arrive, regrouped by local expert, are the grouped
    GEMMs' input: the SwiGLU intermediates and that input scale with the received rows (`routing.received`
    per routed copy); the experts' output goes back by the reverse all-to-all unsaved, and what arrives
    (this rank's own rows) is saved by the gate's product as the routed output was. Two more int64 indices
    per received row: the regrouping permutation and its inverse."""
    r = routing or ExpertRouting()
    k, received = shape.top_k, r.received
    routed = d.matmul * (4 * k * shape.width * received + k * model.hidden * (received + 2))
    router: float = FP32_BYTES * (shape.experts + 2 * k + 1) + INDEX_BYTES * 3 * k
    if r.ep > 1:
        router += INDEX_BYTES * 2 * k * received
    router_input = FP32_BYTES * model.hidden if d.stream < FP32_BYTES else 0.0
    return (routed + router + router_input) * r.token_share


def layer_saved_bytes_per_token_no_ac(model: Any, tp: int, sp: bool, mode: str,
                                      routing: ExpertRouting | None = None) -> float:
    """Per token, the mean over the layers (with model.moe, MoE blocks save more: moe_routing_bytes_per_token);
    each block as `_block_saved_no_ac`."""
    shape = moe_shape(model)
    dense = _block_saved_no_ac(model, tp, sp, mode)
    if shape is None:
        return dense
    moe = _block_saved_no_ac(model, tp, sp, mode, ffn=shape.shared) + moe_routing_bytes_per_token(
        shape, model, dtypes(mode), routing)
    return _over_layers(model, dense, moe, shape)


def moe_block_saved_bytes_per_token_no_ac(model: Any, tp: int, sp: bool, mode: str,
                                          routing: ExpertRouting | None = None) -> float:
    """Per token: what one MoE block (a dense FFN of the shared width plus the routing) saves without
    checkpointing; `layer_saved_bytes_per_token_no_ac` is its mean with the dense blocks."""
    shape = moe_shape(model)
    assert shape is not None, "a MoE block needs model.moe"
    return (_block_saved_no_ac(model, tp, sp, mode, ffn=shape.shared)
            + moe_routing_bytes_per_token(shape, model, dtypes(mode), routing))


def moe_attention_side_saved_bytes_per_token(model: Any, tp: int, sp: bool, mode: str) -> float:
    """Of `_block_saved_no_ac`, the attention side of a block (its RMSNorm, the attention's input and SDPA's
    tensors), the part before a MoE block's dispatch (plan/moe_cost.py's BlockParts)."""
    d = dtypes(mode)
    hidden, q_width, repeated, _, _ = _widths(model, tp)
    seq_split = tp if sp else 1
    norm = (d.stream * hidden + FP32_BYTES) / seq_split
    inputs = 3 * d.matmul * hidden if d.casts_inputs else d.norm_out * hidden / seq_split
    attention = d.matmul * (2 * q_width + 2 * repeated) + FP32_BYTES * model.heads / tp
    return norm + inputs + attention


def _block_saved_no_ac(model: Any, tp: int, sp: bool, mode: str, ffn: float | None = None) -> float:
    """Per token: every tensor one layer saves without checkpointing (see module docstring).

    Per RMSNorm: its input x and an fp32 rstd; per linear group: its input (one shared tensor,
    a sequence shard under sequence parallelism, or one 16-bit cast per linear when autocast
    casts inputs); SDPA: q, repeated k and v,
    output (which wo reuses as its input) and the fp32 log-sum-exp per head; swiglu: w1 out,
    silu out, w3 out and their product (w2's input); gelu: w1 out and gelu out.
    With sequence parallelism the norm-region tensors are split over tp (Korthikanti, section 4.2.2).
    """
    d = dtypes(mode)
    hidden, q_width, repeated, _, ffn_width = _widths(model, tp, ffn)
    seq_split = tp if sp else 1
    norm = (d.stream * hidden + FP32_BYTES) / seq_split
    linears = 0 if ffn == 0 else (2 if model.activation == "swiglu" else 1)  # w1 (and w3); none: no FFN
    casts = 3 + linears  # q, k, v; w1 (and w3)
    inputs = casts * d.matmul * hidden if d.casts_inputs else 2 * d.norm_out * hidden / seq_split
    attention = d.matmul * (2 * q_width + 2 * repeated) + FP32_BYTES * model.heads / tp
    ffn_saved = (4 if model.activation == "swiglu" else 2) * d.matmul * ffn_width
    return 2 * norm + inputs + attention + ffn_saved


def layer_saved_bytes_per_token_selective(model: Any, tp: int, sp: bool, mode: str,
                                          routing: ExpertRouting | None = None) -> float:
    """Per token under the runtime's selective (op-level) policy: the block input plus the
    outputs of every matmul and of SDPA (output + log-sum-exp); everything else is recomputed.
    A MoE block: its grouped GEMMs' outputs (w1, w3: top_k x width; w2: top_k x hidden) and the
    router's fp32 logits are matmul outputs too; a shared expert is a dense FFN of its width. Under expert
    parallelism the GEMMs run on the received rows, and one more [rows, hidden] tensor per routed copy is
    kept: the all-to-all's output that came back (activation_checkpoint.py saves all_to_all_single's
    outputs), measured against MemTracker (bench/memory_accuracy.py's ep configurations)."""
    shape = moe_shape(model)
    dense = _block_saved_selective(model, tp, sp, mode)
    if shape is None:
        return dense
    d = dtypes(mode)
    r = routing or ExpertRouting()
    moe = _block_saved_selective(model, tp, sp, mode, ffn=shape.shared)
    routed = d.matmul * shape.top_k * (2 * shape.width + model.hidden) * r.received
    if r.ep > 1:
        routed += d.matmul * shape.top_k * model.hidden
    moe += (routed + FP32_BYTES * shape.experts) * r.token_share
    return _over_layers(model, dense, moe, shape)


def _block_saved_selective(model: Any, tp: int, sp: bool, mode: str, ffn: float | None = None) -> float:
    d = dtypes(mode)
    hidden, q_width, _, kv_width, ffn_width = _widths(model, tp, ffn)
    block_input = d.stream * hidden / (tp if sp else 1)
    qkv = d.matmul * (q_width + 2 * kv_width)
    sdpa = d.matmul * q_width + FP32_BYTES * model.heads / tp
    # wo and w2 outputs; under TP these are partial sums the policy recomputes, saving the reduced
    # outputs instead: all-reduced (full) or, under sequence parallelism, reduce-scattered (1/tp).
    # The all-gathers of sequence parallelism are recomputed, not saved.
    projections = (1 if ffn == 0 else 2) * d.matmul * hidden if tp == 1 else 0.0
    ffn_out = (2 if model.activation == "swiglu" else 1) * d.matmul * ffn_width
    collectives = 0.0
    if tp > 1:
        collectives = 2 * d.matmul * hidden / (tp if sp else 1)
    return block_input + qkv + sdpa + projections + ffn_out + collectives


def layer_activations(model: Any, tokens: int, tp: int, sp: bool, ac: str, mode: str,
                      routing: ExpertRouting | None = None) -> LayerActivations:
    """Saved and recompute-transient bytes of one layer for a micro-batch of `tokens` tokens."""
    full = layer_saved_bytes_per_token_no_ac(model, tp, sp, mode, routing) * tokens + rope_table_copy_bytes(model, mode)
    if ac == "none":
        return LayerActivations(full, 0.0)
    if ac == "selective":
        kept = layer_saved_bytes_per_token_selective(model, tp, sp, mode, routing) * tokens
        return LayerActivations(kept, max(full - kept, 0.0))
    if ac == "full":
        kept = dtypes(mode).stream * model.hidden / (tp if sp else 1) * tokens
        return LayerActivations(kept, full)
    raise ValueError(f"unknown activation checkpointing mode {ac!r}")


# A kernel that materialises the attention scores (cost.ATTENTION_KERNELS, "materialized") saves the
# softmax output (2 bytes), the dropout mask (1) and the dropout output (2) per score element:
# Korthikanti et al. 2022, eq. 1, the 5as/h term (5 a s^2 b bytes per layer).
SCORE_SAVED_BYTES = 5.0


def materialized_score_activations(layer: LayerActivations, model: Any, tokens: int, tp: int,
                                   ac: str) -> LayerActivations:
    """A layer's activations with the score matrix of a materialising attention kernel: saved
    without checkpointing; with it (full, or Korthikanti's selective) alive only while the layer's
    backward replays its forward."""
    scores = SCORE_SAVED_BYTES * model.heads / tp * model.seq_len * tokens
    if ac == "none":
        return replace(layer, saved_bytes=layer.saved_bytes + scores)
    return replace(layer, recompute_peak_bytes=layer.recompute_peak_bytes + scores)


def rope_table_copy_bytes(model: Any, mode: str) -> float:
    """Per layer: nothing. The model casts the fp32 cos/sin tables to 16 bits once per forward
    and every layer saves views of those two [seq, head_dim] copies (under 1 MiB at seq 2048)."""
    return 0.0


def weight_copy_bytes_per_layer(model: Any, tp: int, mode: str, ac: str = "none") -> float:
    """autocast's 16-bit weight copies one layer saves for backward (0 in the other modes), the mean over
    the layers. autocast caches the copies of nn.Linear weights for the whole step; the MoE experts cast
    their stacked weights themselves (runtime/model/moe.py), so those copies live only as saved inputs of
    the grouped GEMMs: without checkpointing, not under it (the router computes in fp32: no copy)."""
    if not dtypes(mode).casts_weights:
        return 0.0
    shape = moe_shape(model)
    if shape is None:
        return HALF_BYTES * (attention_params(model) + ffn_params(model)) / tp
    h = int(model.hidden)
    routed = 3 * h * shape.experts * shape.width if ac == "none" else 0
    moe = 3 * h * shape.shared + routed
    return HALF_BYTES * (attention_params(model) + _over_layers(model, dense_ffn_params(model), moe, shape)) / tp


# FP8 (train.precision fp8; runtime/parallel/float8.py's `eligible`): the linears converted to torchao's Float8Linear
# (or MXLinear) are those whose full widths are both >= train.fp8.min_width and multiples of FP8_TILE (MX_BLOCK x tp
# for mxfp8: whole blocks on every tp shard); never the head or the router; in a MoE block the attention projections
# and the shared experts only (the routed experts are grouped parameters, not nn.Linear).
FP8_TILE = 16
MX_BLOCK = 32  # OCP MX v1.0 (runtime/parallel/mxfp8.py)


def fp8_linear_params_per_layer(model: Any, tp: int, min_width: int, recipe: str) -> float:
    """The weights of one layer's fp8 linears on one TP rank, the mean over the layers (parameters)."""
    tile = MX_BLOCK * tp if recipe == "mxfp8" else FP8_TILE
    h = int(model.hidden)
    q, kv = model.heads * head_dim(model), model.kv_heads * head_dim(model)
    attention = [(h, q), (h, kv), (h, kv), (q, h)]

    def converted(linears: list[tuple[int, int]]) -> float:
        return sum(i * o for i, o in linears if min(i, o) >= min_width and i % tile == 0 and o % tile == 0) / tp

    ffn = int(model.ffn_hidden)
    dense_ffn = [(h, ffn)] * (2 if model.activation == "swiglu" else 1) + [(ffn, h)]
    shape = moe_shape(model)
    if shape is None:
        return converted(attention + dense_ffn)
    shared = [(h, shape.shared), (h, shape.shared), (shape.shared, h)] if shape.shared else []
    return _over_layers(model, converted(attention + dense_ffn), converted(attention + shared), shape)


@dataclass(frozen=True)
class HeadActivations:
    """The last stage's final norm, head and loss, for one micro-batch on one TP rank."""

    saved_bytes: float  # final norm tensors, head input, log-softmax output (until backward)
    loss_transient_bytes: float  # logits and loss-gradient buffers alive around the loss
    weight_copy_bytes: float  # autocast's 16-bit head weight copy


def head_activations(model: Any, tokens: int, tp: int, sp: bool, mode: str) -> HeadActivations:
    """Final RMSNorm (x, x_hat), the head's input, then the loss on fp32 logits.

    cross_entropy_loss upcasts the logits to fp32 and log_softmax saves its fp32 output; its
    backward briefly holds two fp32 logit-sized gradients, which outweighs the 16-bit logits +
    fp32 copy of the forward (Korthikanti et al. 2022 count the same 4 bytes/logit for the loss).
    """
    d = dtypes(mode)
    vocab = model.vocab / tp
    hidden = float(model.hidden)
    norm = (d.stream * hidden + FP32_BYTES) / (tp if sp else 1)
    head_input = (d.matmul if d.casts_inputs else d.norm_out) * hidden
    log_softmax = FP32_BYTES * vocab
    saved = (norm + head_input + log_softmax) * tokens
    # Loss parallel (tp > 1) computes the cross-entropy on vocab shards with one more buffer.
    transient = (2 if tp == 1 else 3) * FP32_BYTES * vocab * tokens
    copy = HALF_BYTES * model.vocab * model.hidden / tp if d.casts_weights else 0.0
    return HeadActivations(saved, transient, copy)


def backward_transient_bytes(model: Any, tokens: int, tp: int, sp: bool, mode: str) -> float:
    """Gradient buffers alive inside one layer's FFN backward, its largest moment: the incoming
    and outgoing residual-stream gradients, plus for swiglu the gradients of the product and of
    both factors (gelu: of the activation output and input) — counted from the autograd graph
    of runtime/model/transformer.py's FeedForward."""
    d = dtypes(mode)
    ffn_grads = 3 if model.activation == "swiglu" else 2
    stream = 2 * d.stream * model.hidden / (tp if sp else 1)
    return tokens * (ffn_grads * d.matmul * model.ffn_hidden / tp + stream)


def ffn_saved_bytes_per_token(model: Any, tp: int, sp: bool, mode: str) -> float:
    """The part of `layer_saved_bytes_per_token_no_ac` that the FFN itself saves (its input(s) and
    intermediates), freed once its backward has run; the FFN norm's input and rstd stay until the
    norm's own backward."""
    d = dtypes(mode)
    swiglu = model.activation == "swiglu"
    hidden, _, _, _, ffn = _widths(model, tp)
    inputs = (2 if swiglu else 1) * d.matmul * hidden if d.casts_inputs else d.norm_out * hidden / (tp if sp else 1)
    return inputs + (4 if swiglu else 2) * d.matmul * ffn


def norm_backward_transient_bytes(model: Any, tokens: int, tp: int, sp: bool, mode: str) -> float:
    """Buffers alive inside an RMSNorm's backward (runtime/model/norm.py's own autograd, the same code
    on every device): x_hat recomputed in fp32, the gradient upcast to fp32 (a copy only when the
    stream is 16-bit), gradient times weight and two live temporaries of the last expression;
    beside them three stream-sized gradients (the norm's output gradient, the residual's and
    their sum). Counted from the code and checked against MemTracker (tests/plan/
    test_memory_truth.py, where this is the peak of "tp2 bf16 full")."""
    d = dtypes(mode)
    elements = tokens * model.hidden / (tp if sp else 1)
    fp32_tensors = 5 if d.stream < FP32_BYTES else 4
    return elements * (fp32_tensors * FP32_BYTES + 3 * d.stream)


def embedding_backward_transient_bytes(model: Any, tokens: int, tp: int, sp: bool, mode: str) -> float:
    """The embedding's backward writes a whole weight-sized gradient (vocab/tp x hidden, in the
    weight's compute dtype: 16-bit under FSDP's mixed precision, fp32 otherwise) before it is
    accumulated, beside the incoming gradient of the residual stream and its fp32 copy."""
    d = dtypes(mode)
    weight = (HALF_BYTES if mode == "fsdp-mp" else FP32_BYTES) * model.vocab * model.hidden / tp
    stream = tokens * model.hidden / (tp if sp else 1) * (d.stream + FP32_BYTES)
    return weight + stream


def output_projection_backward_bytes(model: Any, tokens: int, tp: int, mode: str) -> float:
    """Inside w2's backward while gradients accumulate (a later micro-batch): the gradient of its
    input (ffn wide) and its new weight gradient before it is added to the held one, in the
    matmul dtype, plus the fp32 copy when autocast computed it from a 16-bit weight copy.
    Checked against MemTracker (tests/plan/test_memory_truth.py, "pp2 1f1b fp32 first stage")."""
    d = dtypes(mode)
    weight = model.hidden * model.ffn_hidden / tp * (d.matmul + (FP32_BYTES if d.casts_weights else 0))
    return tokens * d.matmul * model.ffn_hidden / tp + weight


def ffn_output_input_bytes(model: Any, tokens: int, tp: int, mode: str) -> float:
    """The input of the FFN's output projection (w2), freed first in the layer's backward."""
    return tokens * dtypes(mode).matmul * model.ffn_hidden / tp


def embedding_saved_bytes(tokens: int) -> float:
    """The embedding saves its int64 token ids for the gradient scatter."""
    return INDEX_BYTES * tokens


def in_flight_micro_batches(schedule: str, pp: int, pp_rank: int, micro_batches: int, virtual_stages: int) -> float:
    """Micro-batches of one virtual stage's activations alive at once on pipeline rank `pp_rank`,
    in units of a full rank's layers (so interleaving's chunks are counted as fractions).

    GPipe: all m forwards before any backward (Huang et al. 2019).
    1F1B: at most pp - rank (Narayanan et al. 2021, section 2.2.1; torch's Schedule1F1B warm-up).
    Interleaved 1F1B: (v - 1) * pp + 2 * (pp - rank - 1) + 1 chunk-forwards before the first
    backward (Megatron-LM's and torch's warm-up), each chunk 1/v of the rank's layers.
    """
    if pp == 1 or schedule == "none":
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "1f1b":
        return float(min(pp - pp_rank, micro_batches))
    if schedule == "interleaved-1f1b":
        chunks = (virtual_stages - 1) * pp + 2 * (pp - pp_rank - 1) + 1
        return min(chunks, micro_batches * virtual_stages) / virtual_stages
    raise ValueError(f"unknown schedule {schedule!r}")
