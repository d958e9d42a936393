"""The model states of one rank: its parameters, gradients and optimizer states and FSDP's gathered copies, in
bytes, as hpctrain's runtime keeps them (plan/memory.py's module docstring: fp32 master weights and gradients,
AdamW's two fp32 moments, a 16-bit gathered copy for compute), sharded by ZeRO stage over dp x cp and the routed
experts over efsdp. plan/memory.py places them in the phases of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.plan.activations import FP32_BYTES, HALF_BYTES, fp8_linear_params_per_layer
from hpctrain.plan.lora import adapter_params, adapter_params_per_layer
from hpctrain.plan.model_stats import (
    attention_params as attention_param_count,
    embedding_param_count,
    final_norm_param_count,
    head_param_count,
    layer_norm_params,
    layer_param_count,
    moe_layer_count,
    routed_expert_params,
    stage_param_count,
    stage_routed_expert_params,
)
from hpctrain.plan.rank_setup import RankSetup


def optimizer_bytes_per_param(optimizer: str) -> int:
    """AdamW: two fp32 moments (Loshchilov & Hutter 2019); SGD with momentum: one; plain SGD: none."""
    return {"adamw": 8, "sgd-momentum": 4, "sgd": 0}[optimizer]


def rank_params(model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup, pp_rank: int) -> tuple[int, int]:
    """(parameters of this rank's stages on one TP rank, its layer count)."""
    params, layers = 0, 0
    last = len(stage_layers) - 1
    for index in range(pp_rank, len(stage_layers), setup.pp):
        first_layer, end_layer = stage_layers[index]
        params += stage_param_count(model, first_layer, end_layer, has_embedding=index == 0,
                                    has_head=index == last, tp=setup.tp, ep=setup.ep)
        layers += end_layer - first_layer
    return params, layers


def rank_routed_params(model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup, pp_rank: int) -> int:
    """The routed-expert parameters among `rank_params`'s: E/ep experts per MoE block."""
    return sum(stage_routed_expert_params(model, *stage_layers[index], ep=setup.ep)
               for index in range(pp_rank, len(stage_layers), setup.pp))


def rank_layer_params(model: Any, tp: int, ep: int = 1) -> float:
    """One layer's parameters on a rank, the mean over the layers: everything by tp, but under expert
    parallelism the routed experts by ep instead (whole experts, not tensor-parallel) and the router whole."""
    per_layer = layer_param_count(model) / tp
    if ep == 1 or not moe_layer_count(model):
        return per_layer
    norms = layer_norm_params(model)  # replicated under TP (the ep=1 figure above divides them too: a few KiB)
    per_layer = (layer_param_count(model) - norms) / tp + norms
    share = moe_layer_count(model) / int(model.layers)
    routed, router = share * routed_expert_params(model), share * int(model.moe.experts) * int(model.hidden)
    return per_layer - (routed + router) / tp + routed / ep + router  # the router is replicated


@dataclass(frozen=True)
class States:
    """Parameter-sized buffers of one rank (bytes)."""

    master: float
    rope: float
    unsharded_forward: float
    unsharded_backward: float
    optimizer: float
    grads_sharded: float
    grads_held: float  # gradients present while a micro-batch runs (accumulated from earlier ones)
    grads_fresh_at_end: float  # in the backward of the rank's last-processed layer, one micro-batch
    grads_fresh_at_norm: float  # in that layer's FFN-norm backward (its FFN's gradients exist)
    grads_fresh_at_embedding: float  # in the embedding's backward: every gradient but its own
    accumulation: float
    reduce_buffer: float


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts `rank_states` reads that depend on the model and (tp, ep) only."""

    layer_params: float  # rank_layer_params
    # The first and the last block on a rank of a one-stage pipeline: FSDP keeps one of them gathered at the end of
    # forward (the last) and at the end of backward (the first). A MoE model's leading dense_layers make those two
    # blocks differ from the mean (layer_params); otherwise they are the mean.
    first_block: float
    last_block: float
    routed_experts: float  # routed_expert_params (one MoE block's)
    head_unit: float  # head + final norm, per TP rank
    embedding: float  # the whole table
    attention: float  # one layer's attention projections


def model_counts(model: Any, tp: int, ep: int) -> ModelCounts:
    moe = getattr(model, "moe", None)
    mean = rank_layer_params(model, tp, ep)
    first = last = mean
    if moe is not None and int(moe.dense_layers) > 0:
        layers = int(model.layers)

        def block(index: int) -> float:
            return float(stage_param_count(model, index, index + 1, has_embedding=False, has_head=False, tp=tp, ep=ep))

        first, last = block(0), block(layers - 1)
    return ModelCounts(mean, first, last, float(routed_expert_params(model)) if moe else 0.0,
                       (head_param_count(model) + final_norm_param_count(model)) / tp,
                       float(embedding_param_count(model)), float(attention_param_count(model)))


def rank_states(model: Any, stage_layers: list[tuple[int, int]], s: RankSetup, pp_rank: int, fsdp: bool, mode: str,
                params: int, layers: int, counts: ModelCounts, routed: float) -> States:
    """`routed`: the rank's routed-expert parameters under ep > 1 (`rank_routed_params`), else 0."""
    on_gpu = 0.0 if s.offload_optimizer else 1.0
    layer_params = counts.layer_params
    # Routed experts are an FSDP unit of their own over efsdp ranks (runtime/parallel/expert.py's
    # shard_experts), the rest over dp: `sharded(total, experts)` is a parameter-sized buffer per rank
    # whose `experts` part (in parameters) is sharded over efsdp (dp x cp x tp / ep). At ep=1 the experts
    # are part of their block: one degree. With context parallelism the dense part is sharded over dp x cp.
    dense_shard, expert_shard = (s.dp * s.cp, s.efsdp) if fsdp else (1, 1)

    def sharded(total: float, experts: float) -> float:
        return (total - experts) / dense_shard + experts / expert_shard

    first_layer = stage_layers[pp_rank][0]
    # The rank's last-processed layer (its first) still lacks its experts' gradients in its FFN backward.
    first_routed = (counts.routed_experts / s.ep
                    if routed and first_layer >= int(model.moe.dense_layers) else 0.0)
    compute_bytes = HALF_BYTES if mode == "fsdp-mp" else FP32_BYTES
    unsharded_fwd = unsharded_bwd = 0.0
    fp8_saving = fp8_gathered_saving(model, s, compute_bytes) if fsdp else 0.0  # per gathered layer
    if fsdp and s.zero >= 3 and s.pp == 1 and model.tie_embeddings:
        # The tied embedding, norm and head stay in the root unit (runtime/parallel/fsdp.py):
        # after forward only the last block stays gathered; in backward the root and one block.
        unsharded_fwd = compute_bytes * counts.last_block - fp8_saving
        unsharded_bwd = compute_bytes * (params - layers * layer_params + counts.first_block) - fp8_saving
    elif fsdp and s.zero >= 3 and s.pp == 1:
        # FSDP units of their own (runtime/parallel/fsdp.py's table): after forward the last
        # block and the norm + head unit stay gathered (the embedding was resharded); in the
        # backward of the first layer that layer and the embedding are gathered (the head was
        # resharded after its backward). Measured against MemTracker (bench/memory_accuracy.py).
        unsharded_fwd = compute_bytes * (counts.last_block + counts.head_unit) - fp8_saving
        unsharded_bwd = compute_bytes * (counts.first_block + counts.embedding / s.tp) - fp8_saving
    elif fsdp:
        unsharded_fwd = unsharded_bwd = compute_bytes * params - layers * fp8_saving
    # train.embedding_on_cpu (runtime/parallel/host_embedding.py): the first stage's table is no FSDP unit and
    # never on the device, nor its gradient or optimizer state (tp is 1: validate refuses more).
    host_table = counts.embedding if s.embedding_on_cpu and pp_rank == 0 else 0.0
    if host_table:
        params = int(params - host_table)
        if fsdp and s.zero >= 3 and s.pp == 1:
            unsharded_bwd -= compute_bytes * host_table
        elif fsdp:
            unsharded_fwd = unsharded_bwd = compute_bytes * params - layers * fp8_saving
    # Trained parameters (everything, or LoRA's adapters): gradients, optimizer states, FSDP's
    # gradient buffers. Held parameters (fp32, FSDP-gathered) are the base plus the adapters.
    w2_params = model.hidden * model.ffn_hidden / s.tp
    embedding = counts.embedding / s.tp if pp_rank == 0 and not host_table else 0.0
    trained, trained_layer = float(params), layer_params
    trained_routed = routed
    if s.lora is not None:
        trained_routed = first_routed = 0.0  # LoRA adapts the attention projections only (config/job.py)
        trained_layer = adapter_params_per_layer(model, s.lora, s.tp)
        trained, params = layers * trained_layer, int(params + layers * trained_layer)
        w2_params = adapter_params(model, s.lora, "w2", s.tp) if "w2" in s.lora.targets else 0.0
        embedding = 0.0
        if fsdp:
            unsharded_fwd += compute_bytes * trained_layer * (1 if s.zero >= 3 and s.pp == 1 else layers)
            unsharded_bwd += compute_bytes * trained_layer * (1 if s.zero >= 3 and s.pp == 1 else layers)
    grads_sharded = FP32_BYTES * sharded(trained, trained_routed) * on_gpu
    accumulating = s.micro_batches > 1 or s.pp > 1
    deferred = fsdp and (s.zero <= 1 or s.pp > 1) and s.micro_batches > 1
    # The backward peak of the last-processed layer (the rank's first) is in its FFN backward:
    # every other gradient exists except the embedding's and that layer's, but for w2's.
    fresh = FP32_BYTES * sharded(trained - embedding - trained_layer + w2_params,
                                 trained_routed - first_routed) * on_gpu
    # Later moments (memory.py's _late_backward_phases): the FFN norm's backward, where the
    # first layer's attention gradients are still missing, and the embedding's backward.
    attention_trained = (counts.attention + model.hidden) / s.tp
    if s.lora is not None:
        attention_trained = sum(adapter_params(model, s.lora, t, s.tp) for t in s.lora.targets
                                if t in ("wq", "wk", "wv", "wo"))
    fresh_norm = FP32_BYTES * sharded(trained - embedding - attention_trained, trained_routed) * on_gpu
    fresh_embedding = FP32_BYTES * sharded(trained - embedding, trained_routed) * on_gpu
    held = 0.0 if (not accumulating or deferred) else grads_sharded
    return States(
        master=FP32_BYTES * sharded(params, routed) * on_gpu,
        rope=2.0 * FP32_BYTES * model.seq_len * (model.hidden // model.heads) * stage_layers_on_rank(stage_layers, s.pp, pp_rank),
        unsharded_forward=unsharded_fwd, unsharded_backward=unsharded_bwd,
        optimizer=optimizer_bytes_per_param(s.optimizer) * sharded(trained, trained_routed) * on_gpu,
        grads_sharded=grads_sharded, grads_held=held, grads_fresh_at_end=0.0 if deferred else fresh,
        grads_fresh_at_norm=0.0 if deferred else fresh_norm,
        grads_fresh_at_embedding=0.0 if deferred else fresh_embedding,
        accumulation=FP32_BYTES * trained if deferred else 0.0,
        # FSDP2 reduce-scatters each block's gradient from an fp32 copy of its unsharded gradient.
        reduce_buffer=(FP32_BYTES + compute_bytes) * trained_layer if fsdp else 0.0,
    )


def states_key(s: RankSetup, mode: str, pp_rank: int) -> tuple[Any, ...]:
    """Every field of `s` that `rank_states` reads (with the precision mode and the rank; the stage split is one per
    (pp, virtual_stages) within a cache, `_phase_items`' contract): what a search's micro-batch, schedule and
    recomputation choices leave alone, so their candidates share one computation."""
    return ("states", mode, pp_rank, s.tp, s.pp, s.virtual_stages, s.dp, s.cp, s.ep, s.zero, s.offload_optimizer,
            s.embedding_on_cpu, s.lora, s.optimizer, s.micro_batches > 1, s.fp8_recipe, s.fp8_min_width)


def fp8_gathered_saving(model: Any, s: RankSetup, compute_bytes: float) -> float:
    """Per layer: what FSDP2's fp8 all-gather (recipe tensorwise, runtime/parallel/float8.py's
    enable_fsdp_float8_all_gather) saves on the unsharded weights: the fp8 linears arrive in one byte, not
    `compute_bytes`."""
    if s.fp8_recipe != "tensorwise":
        return 0.0
    return (compute_bytes - 1.0) * fp8_linear_params_per_layer(model, s.tp, s.fp8_min_width, s.fp8_recipe)


def stage_layers_on_rank(stage_layers: list[tuple[int, int]], pp: int, pp_rank: int) -> int:
    """How many model parts (virtual stages) a pipeline rank holds: each has its own RoPE tables."""
    return len(range(pp_rank, len(stage_layers), pp))
