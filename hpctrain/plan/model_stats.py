"""Model accounting: parameter counts and training FLOPs per token, from job.model alone.

The counted architecture is the runtime's (hpctrain/runtime/model/transformer.py): token embedding
[vocab, hidden]; per layer an RMSNorm [hidden], q [hidden, heads*head_dim], k and v
[hidden, kv_heads*head_dim], o [heads*head_dim, hidden], an RMSNorm [hidden] and the FFN
(gelu: up + down; swiglu: gate + up + down, each hidden x ffn_hidden); a final RMSNorm [hidden];
the head [hidden, vocab] unless tied. head_dim = model.head_dim (default hidden // heads); q/k RMSNorms
[head_dim] with model.qk_norm. No biases anywhere. With model.moe the FFN of a MoE block is the router, the
routed experts and the shared experts (`moe_ffn_params`); per-layer figures are then means over the
layers (exact in total; a stage's share is exact when dense_layers is 0), and FLOPs count the active
experts only (top_k routed + shared + the router).

`flops_per_token` is THE FLOP formula of the project: the runtime's MFU and the planner's cost
model both call it (docs/architecture.md: the metrics record).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

AcMode = Literal["none", "selective", "full"]
AC_MODES: tuple[AcMode, ...] = ("none", "selective", "full")

# Cross-entropy on top of the logits: max, subtract, exp, sum and the gather, forward and backward.
# A few elementwise FLOPs per logit; tiny next to the head's 6*hidden per logit and left out of
# flops_per_token (as in PaLM's and Megatron's formulas); stages.py charges it to the last stage.
LOSS_TRAINING_FLOPS_PER_LOGIT = 8.0


def head_dim(model: Any) -> int:
    """Per-head width: model.head_dim, which defaults to hidden // heads."""
    return int(getattr(model, "head_dim", None) or int(model.hidden) // int(model.heads))


def ffn_matrices(model: Any) -> int:
    """How many hidden x ffn_hidden matrices one FFN holds (gelu: up, down; swiglu: gate, up, down)."""
    return 3 if model.activation == "swiglu" else 2


def attention_params(model: Any) -> int:
    """q, k, v and o projections of one layer (GQA: k and v have kv_heads heads)."""
    q_width = int(model.heads) * head_dim(model)
    kv_width = int(model.kv_heads) * head_dim(model)
    return int(model.hidden) * (2 * q_width + 2 * kv_width)


def dense_ffn_params(model: Any) -> int:
    """The matrices of one dense FFN."""
    return ffn_matrices(model) * int(model.hidden) * int(model.ffn_hidden)


def moe_layer_count(model: Any) -> int:
    """Blocks whose FFN is a Mixture of Experts (model.moe; the first dense_layers stay dense)."""
    moe = getattr(model, "moe", None)
    return 0 if moe is None else max(0, int(model.layers) - int(moe.dense_layers))


def moe_ffn_params(model: Any, active: bool = False) -> int:
    """One MoE FFN (runtime/model/moe.py): the router [experts, hidden], every routed SwiGLU expert
    (active=True: the top_k a token uses) and the shared experts' SwiGLU."""
    from hpctrain.config.moe import expert_width, shared_width

    moe, h = model.moe, int(model.hidden)
    routed = int(moe.top_k if active else moe.experts)
    return moe.experts * h + 3 * h * (routed * expert_width(moe, int(model.ffn_hidden))
                                      + shared_width(moe, int(model.ffn_hidden)))


def routed_expert_params(model: Any) -> int:
    """The routed experts of one MoE block (experts x SwiGLU of the expert width): what expert parallelism
    splits over ep (runtime/parallel/expert.py), never over tp (torchtitan's etp=1: experts whole)."""
    from hpctrain.config.moe import expert_width

    moe = model.moe
    return int(moe.experts) * 3 * int(model.hidden) * expert_width(moe, int(model.ffn_hidden))


def ffn_params(model: Any, active: bool = False) -> int:
    """The FFN parameters of one layer; with model.moe the mean over the layers (dense and MoE blocks), so
    layers x this is the model's total (active=True: those one token's forward uses)."""
    n_moe = moe_layer_count(model)
    if not n_moe:
        return dense_ffn_params(model)
    layers = int(model.layers)
    return ((layers - n_moe) * dense_ffn_params(model) + n_moe * moe_ffn_params(model, active)) // layers


def layer_norm_params(model: Any) -> int:
    """The RMSNorm weights of one layer (two, plus q/k's with model.qk_norm; replicated under TP)."""
    return 2 * int(model.hidden) + (2 * head_dim(model) if getattr(model, "qk_norm", False) else 0)


def layer_param_count(model: Any) -> int:
    """All parameters of one transformer layer."""
    return attention_params(model) + ffn_params(model) + layer_norm_params(model)


def embedding_param_count(model: Any) -> int:
    """The token embedding [vocab, hidden]."""
    return int(model.vocab) * int(model.hidden)


def head_param_count(model: Any) -> int:
    """The output head [hidden, vocab]; 0 when it is tied to the embedding."""
    return 0 if model.tie_embeddings else int(model.vocab) * int(model.hidden)


def final_norm_param_count(model: Any) -> int:
    """The RMSNorm before the head."""
    return int(model.hidden)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part. `total` equals sum(p.numel()) of the runtime's full model."""

    embedding: int
    per_layer: int
    layers: int
    final_norm: int
    head: int

    @property
    def total(self) -> int:
        return self.embedding + self.per_layer * self.layers + self.final_norm + self.head


def param_counts(model: Any) -> ParamCounts:
    """Parameter counts of the whole model, by part."""
    return ParamCounts(
        embedding=embedding_param_count(model),
        per_layer=layer_param_count(model),
        layers=int(model.layers),
        final_norm=final_norm_param_count(model),
        head=head_param_count(model),
    )


def param_count(model: Any) -> int:
    """All parameters of the model (tied embeddings counted once)."""
    return param_counts(model).total


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_STAGE_CACHE: dict[tuple[Any, ...], int] = {}


def stage_param_count(
    model: Any, first_layer: int, last_layer: int, *, has_embedding: bool, has_head: bool, tp: int = 1,
    ep: int = 1,
) -> int:
    """`_stage_param_count`, cached per shape and arguments: the search asks for it thousands of times."""
    key = (_shape_key(model), first_layer, last_layer, has_embedding, has_head, tp, ep)
    count = _STAGE_CACHE.get(key)
    if count is None:
        count = _STAGE_CACHE[key] = _stage_param_count(model, first_layer, last_layer, has_embedding=has_embedding,
                                                       has_head=has_head, tp=tp, ep=ep)
    return count


def _stage_param_count(
    model: Any, first_layer: int, last_layer: int, *, has_embedding: bool, has_head: bool, tp: int = 1,
    ep: int = 1,
) -> int:
    """Parameters one TP rank of a pipeline stage holds, before any DP (FSDP) sharding.

    Megatron-style TP (Shoeybi et al. 2019, section 3): q/k/v/up/gate column-parallel and o/down
    row-parallel split their matrices by tp; RMSNorm weights are replicated; the embedding and the
    head are vocab-parallel (rows of the vocab split by tp, the largest shard counted). A tied
    model split over several stages keeps a head copy on the last stage (Megatron keeps a copy and
    all-reduces its gradient with the embedding's), so `has_head` counts [hidden, vocab] then too.
    With model.moe the stage's dense blocks (the first dense_layers) and MoE blocks are counted apart; with
    ep > 1 a MoE block holds experts/ep routed experts, whole (not tensor-parallel: torchtitan's etp=1 rule,
    which the runtime follows), a replicated router and its shared experts split by tp like a dense FFN.
    At ep=1 the block counts as before (everything but the norms by tp), which is what the runtime's
    `Training.param_count_before_dp` reports for its global-shape expert DTensors.
    """
    per_layer, vocab_params, norm = _tp_shard_sizes(model, tp)
    count = (last_layer - first_layer) * per_layer
    if moe_layer_count(model):
        dense = max(0, min(last_layer, int(model.moe.dense_layers)) - first_layer)
        attention_and_norms = attention_params(model) // tp + layer_norm_params(model)
        moe_block = attention_and_norms + moe_ffn_params(model) // tp
        if ep > 1:
            routed = routed_expert_params(model)
            router = int(model.moe.experts) * int(model.hidden)
            moe_block = (attention_and_norms + router + (moe_ffn_params(model) - routed - router) // tp
                         + routed // ep)
        count = (dense * (attention_and_norms + dense_ffn_params(model) // tp)
                 + (last_layer - first_layer - dense) * moe_block)
    if has_embedding:
        count += vocab_params
    if has_head:
        count += norm
        if not model.tie_embeddings or not has_embedding:
            count += vocab_params
    return count


def stage_routed_expert_params(model: Any, first_layer: int, last_layer: int, ep: int = 1) -> int:
    """The routed-expert parameters among `stage_param_count`'s (what FSDP shards over efsdp, not dp)."""
    if not moe_layer_count(model):
        return 0
    dense = max(0, min(last_layer, int(model.moe.dense_layers)) - first_layer)
    return (last_layer - first_layer - dense) * (routed_expert_params(model) // ep)


_SHARD_CACHE: dict[tuple[Any, ...], tuple[int, int, int]] = {}


def _shape_key(model: Any) -> tuple[Any, ...]:
    """Every field parameter counts depend on (the MoE section's sizes; its router settings hold no
    parameters of their own beyond the [experts, hidden] matrix)."""
    moe = getattr(model, "moe", None)
    moe_key = None if moe is None else (moe.experts, moe.top_k, moe.expert_ffn_hidden, moe.shared_experts,
                                        moe.shared_ffn_hidden, moe.dense_layers)
    return (model.layers, model.hidden, model.heads, model.kv_heads, model.ffn_hidden, model.vocab,
            model.activation, getattr(model, "head_dim", None), getattr(model, "qk_norm", False),
            model.tie_embeddings, moe_key)


def _tp_shard_sizes(model: Any, tp: int) -> tuple[int, int, int]:
    """(one layer's parameters on a TP rank, the vocab-parallel embedding/head shard, the final
    norm), cached per shape: the search asks for them thousands of times."""
    key = (_shape_key(model), tp)
    sizes = _SHARD_CACHE.get(key)
    if sizes is None:
        sharded = attention_params(model) + ffn_params(model)
        sizes = (sharded // tp + layer_norm_params(model), _ceil_div(int(model.vocab), tp) * int(model.hidden),
                 final_norm_param_count(model))
        _SHARD_CACHE[key] = sizes
    return sizes


# ---------------------------------------------------------------------------------------------
# FLOPs. A multiply-add is 2 FLOPs. Forward FLOPs per token of a matmul with P weights = 2P;
# backward = 2x forward (gradients w.r.t. inputs and weights), so training = 3x forward
# (Kaplan et al. 2020, "Scaling Laws", section 2.1; Narayanan et al. 2021, appendix eq. 3).
# Attention adds QK^T and AV: 2 * seq * (heads*head_dim) each per token forward, counted over the
# full (non-causal) score matrix as PaLM (Chowdhery et al. 2022, appendix B) and Megatron do.
# ---------------------------------------------------------------------------------------------

def attention_core_forward_flops_per_token(model: Any) -> float:
    """QK^T and AV of one layer, per token, forward: 4 * seq_len * heads * head_dim."""
    return 4.0 * int(model.seq_len) * int(model.heads) * head_dim(model)


def layer_forward_flops_per_token(model: Any) -> float:
    """One transformer layer's forward FLOPs per token (matmuls + attention core)."""
    matmul_params = attention_params(model) + ffn_params(model, active=True)
    return 2.0 * matmul_params + attention_core_forward_flops_per_token(model)


def head_forward_flops_per_token(model: Any) -> float:
    """The head matmul (present whether tied or not), per token, forward."""
    return 2.0 * int(model.hidden) * int(model.vocab)


def loss_training_flops_per_token(model: Any) -> float:
    """Cross-entropy forward + backward per token (elementwise over the vocab; not in MFU)."""
    return LOSS_TRAINING_FLOPS_PER_LOGIT * int(model.vocab)


def recompute_flops_per_token(model: Any, ac_mode: str) -> float:
    """Extra forward FLOPs per token that activation checkpointing re-runs in the backward pass.

    full: every layer's forward again (Narayanan et al. 2021: 4x instead of 3x forward);
    selective: the runtime's op-level policy (runtime/parallel/activation_checkpoint.py) saves the outputs
    of every matmul and of attention and recomputes only element-wise ops, so no matmul FLOPs
    (Korthikanti et al. 2022's selective recompute of the attention core is not needed: flash
    attention keeps no seq x seq matrix);
    none: nothing. The head and the loss are never recomputed.
    """
    if ac_mode == "full":
        return int(model.layers) * layer_forward_flops_per_token(model)
    if ac_mode in ("selective", "none"):
        return 0.0
    raise ValueError(f"unknown activation checkpointing mode {ac_mode!r}; expected one of {AC_MODES}")


def flops_per_token(model: Any, ac_mode: str = "none") -> float:
    """Training FLOPs per token: 3x forward of all layers and the head, plus recompute.

    With ac_mode="none" this is the model FLOPs used for MFU (recompute is not useful work,
    PaLM appendix B); with the job's ac mode it is the hardware FLOPs the GPUs execute
    (what Megatron's TFLOP/s figures count).
    """
    forward = int(model.layers) * layer_forward_flops_per_token(model) + head_forward_flops_per_token(model)
    return 3.0 * forward + recompute_flops_per_token(model, ac_mode)


def model_flops_per_token(model: Any) -> float:
    """Useful training FLOPs per token (no recompute): the numerator of MFU."""
    return flops_per_token(model, "none")
