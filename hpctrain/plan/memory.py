"""Memory per rank: model states, activations and buffers, as a breakdown at the peak moment.

Model states follow the ZeRO paper (Rajbhandari et al. 2019, section 5.1 and figure 1): with
mixed-precision Adam a parameter costs 2 (16-bit weight) + 2 (16-bit gradient) + K = 12
(fp32 master, momentum, variance) bytes; ZeRO stage 1 shards the K bytes over the Nd data-parallel
ranks, stage 2 also the gradients, stage 3 also the weights (`model_states_bytes`).

The runtime (hpctrain/runtime) keeps fp32 parameters as the master weights and fp32 gradients and
sharding is FSDP2's (data_parallel.py): a parameter costs 4 + 4 + 8 (AdamW moments) bytes, all
sharded over dp whenever FSDP is on, plus a 16-bit unsharded copy for compute. `rank_memory`
accounts for that runtime, phase by phase (end of forward, end of backward, optimizer step), and
reports the components of the phase with the highest total — which is what a memory tracker or
torch.cuda.max_memory_allocated sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpctrain.plan.activations import (
    FP32_BYTES,
    HALF_BYTES,
    embedding_saved_bytes,
    head_activations,
    in_flight_micro_batches,
    layer_activations,
    precision_mode,
    weight_copy_bytes_per_layer,
)
from hpctrain.plan.model_stats import largest_layer_param_count, layer_param_count, stage_param_count

GIB = 2**30
# CUDA context + cuBLAS/cuDNN workspaces + NCCL buffers + allocator fragmentation, per GPU, when the
# job does not set cluster.runtime_overhead_gib: a CUDA 12 context with NCCL on 8 GPUs takes
# 0.5-1 GiB (nvidia-smi on an idle initialised process); fragmentation adds a few percent.
DEFAULT_RUNTIME_OVERHEAD_BYTES = 2 * GIB


def model_states_bytes(
    params: float, dp: int, zero: int, *, weight_bytes: float = 2, grad_bytes: float = 2,
    optimizer_bytes: float = 12, offload_optimizer: bool = False,
) -> float:
    """Model-state bytes per GPU (ZeRO paper, figure 1: Psi(2 + 2 + K), /Nd per sharded part).

    offload_optimizer moves the optimizer states and the gradients to the CPU (ZeRO-Offload,
    Ren et al. 2021, section 4.1): the GPU keeps only the 16-bit weights.
    """
    weights = params * weight_bytes / (dp if zero >= 3 else 1)
    if offload_optimizer:
        return weights
    grads = params * grad_bytes / (dp if zero >= 2 else 1)
    optimizer = params * optimizer_bytes / (dp if zero >= 1 else 1)
    return weights + grads + optimizer


def deepspeed_zero3_gpu_bytes(
    total_params: float, largest_layer_params: float, gpus: int, *, offload_optimizer: bool = False,
    offload_params: bool = False,
) -> float:
    """DeepSpeed's ZeRO-3 estimate (deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs):
    4 bytes x the largest layer (its gathered 16-bit weights and gradients) plus 18 bytes/param
    (2 weight + 4 fp32 gradient + 12 Adam) sharded over the GPUs; offloading the optimizer keeps
    the 2-byte weight shards only, offloading parameters too keeps nothing but the largest layer."""
    gathered = 4 * largest_layer_params
    if offload_params:
        return gathered
    states = model_states_bytes(total_params, gpus, 3, weight_bytes=2, grad_bytes=4, optimizer_bytes=12,
                                offload_optimizer=offload_optimizer)
    return gathered + states


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per component at the peak phase; `items` explains every component (name, bytes)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    other: float
    phase: str
    items: tuple[tuple[str, float], ...] = field(default=())

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.other

    def gib(self) -> dict[str, float]:
        """The `memory_gib` object of plan.json."""
        parts = {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                 "activations": self.activations, "other": self.other, "total": self.total}
        return {key: round(value / GIB, 3) for key, value in parts.items()}


@dataclass(frozen=True)
class RankSetup:
    """Everything about one layout that memory depends on."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    micro_batches: int  # per step per pipeline (global_batch / dp / micro_batch)
    schedule: str  # "none" when pp == 1
    virtual_stages: int
    ac: str
    zero: int
    offload_optimizer: bool
    sequence_parallel: bool
    precision: str
    optimizer: str  # "adamw" | "sgd" | "sgd-momentum"
    foreach: bool = True
    overhead_bytes: float = DEFAULT_RUNTIME_OVERHEAD_BYTES


def optimizer_bytes_per_param(optimizer: str) -> int:
    """AdamW: two fp32 moments (Loshchilov & Hutter 2019); SGD with momentum: one; plain SGD: none."""
    return {"adamw": 8, "sgd-momentum": 4, "sgd": 0}[optimizer]


def _rank_params(model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup, pp_rank: int) -> tuple[int, int]:
    """(parameters of this rank's stages on one TP rank, its layer count)."""
    params, layers = 0, 0
    last = len(stage_layers) - 1
    for index in range(pp_rank, len(stage_layers), setup.pp):
        first_layer, end_layer = stage_layers[index]
        params += stage_param_count(model, first_layer, end_layer, has_embedding=index == 0,
                                    has_head=index == last, tp=setup.tp)
        layers += end_layer - first_layer
    return params, layers


def rank_memory(model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup, pp_rank: int) -> MemoryBreakdown:
    """Peak memory of pipeline rank `pp_rank` (any of its tp x dp replicas), with its breakdown."""
    s = setup
    fsdp = s.dp > 1 or s.offload_optimizer
    mode = precision_mode(s.precision, fsdp)
    params, layers = _rank_params(model, stage_layers, s, pp_rank)
    first, last = pp_rank == 0, pp_rank == s.pp - 1
    shard = s.dp if fsdp else 1
    on_gpu = 0.0 if s.offload_optimizer else 1.0
    compute_bytes = HALF_BYTES if mode == "fsdp-mp" else FP32_BYTES

    master = FP32_BYTES * params / shard * on_gpu
    if not fsdp:
        unsharded = 0.0
    elif s.zero >= 3 and s.pp == 1:
        # Resharded after forward except the last block; in backward one block ahead is prefetched.
        extra = (params - layers * layer_param_count(model) / s.tp) if (first or last) else 0.0
        unsharded = compute_bytes * (2 * layer_param_count(model) / s.tp + extra)
    else:
        unsharded = compute_bytes * params
    optimizer = optimizer_bytes_per_param(s.optimizer) * params / shard * on_gpu
    grads_final = FP32_BYTES * params / shard * on_gpu
    # Unsharded fp32 gradients accumulate over micro-batches when the reduce-scatter is deferred
    # (zero 0/1, or any zero under pipelining: torch's schedule syncs on the last micro-batch only).
    deferred = fsdp and (s.zero <= 1 or s.pp > 1) and s.micro_batches > 1
    grads_accumulated = FP32_BYTES * params if deferred else (grads_final if s.micro_batches > 1 or s.pp > 1 else 0.0)

    tokens = s.micro_batch * model.seq_len
    layer = layer_activations(model, tokens, s.tp, s.sequence_parallel, s.ac, mode)
    head = head_activations(model, tokens, s.tp, s.sequence_parallel, mode)
    in_flight = in_flight_micro_batches(s.schedule, s.pp, pp_rank, s.micro_batches, s.virtual_stages)
    weight_copies = layers * weight_copy_bytes_per_layer(model, s.tp, mode) + (head.weight_copy_bytes if last else 0.0)
    saved = in_flight * (layers * layer.saved_bytes + (embedding_saved_bytes(tokens) if first else 0.0))
    head_saved = head.saved_bytes if last else 0.0
    loss_transient = head.loss_transient_bytes if last else 0.0
    # Gradient reduce-scatter input (fp32, one block) in flight beside the backward (FSDP2).
    comm = FP32_BYTES * largest_layer_param_count(model) / s.tp if fsdp else 0.0

    phases = {
        "forward": (master + unsharded, grads_accumulated, optimizer,
                    saved + head_saved + weight_copies, loss_transient + comm),
        "backward": (master + unsharded, grads_accumulated, optimizer,
                     saved + weight_copies + layer.recompute_peak_bytes, comm),
        "optimizer": (master, grads_final, optimizer, 0.0,
                      FP32_BYTES * params / shard * on_gpu if s.foreach and s.optimizer == "adamw" else 0.0),
    }
    name, (w, g, o, a, other) = max(phases.items(), key=lambda kv: sum(kv[1]))
    items = (
        ("fp32 master weights", master), ("unsharded 16-bit compute weights", unsharded if name != "optimizer" else 0.0),
        ("gradients", g), ("optimizer states", o),
        ("saved activations", saved + (head_saved if name == "forward" else 0.0)),
        ("autocast weight copies", weight_copies if name != "optimizer" else 0.0),
        ("recompute transient", layer.recompute_peak_bytes if name == "backward" else 0.0),
        ("logits and loss buffers", loss_transient if name == "forward" else 0.0),
        ("communication buckets", comm if name != "optimizer" else 0.0),
        ("foreach optimizer temporary", other if name == "optimizer" else 0.0),
        ("runtime overhead (CUDA context, allocator)", s.overhead_bytes),
    )
    return MemoryBreakdown(w, g, o, a, other + s.overhead_bytes, name, tuple((k, v) for k, v in items if v))


def peak_rank_memory(model: Any, stage_layers: list[tuple[int, int]], setup: RankSetup) -> tuple[int, MemoryBreakdown]:
    """The most loaded pipeline rank and its breakdown. Ranks 0 (most micro-batches in flight,
    the embedding), pp-1 (head and loss) and the rank with the most layers are the candidates."""
    if setup.pp == 1:
        return 0, rank_memory(model, stage_layers, setup, 0)
    sizes = [0] * setup.pp
    for index, (a, b) in enumerate(stage_layers):
        sizes[index % setup.pp] += b - a
    candidates = {0, setup.pp - 1, sizes.index(max(sizes))}
    results = [(rank, rank_memory(model, stage_layers, setup, rank)) for rank in sorted(candidates)]
    return max(results, key=lambda item: item[1].total)
