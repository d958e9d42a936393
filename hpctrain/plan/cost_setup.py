"""What the step-time model takes and gives: `CostSetup` (one layout with the software that runs it) and `StepCost`
(the step's terms), plus `memoised`, one search's store of the terms that repeat across its layouts. plan/cost.py
computes a StepCost from a CostSetup; plan/moe_cost.py adds the expert-parallel terms; plan/search.py builds the
setups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from hpctrain.plan.kernels import DEFAULT_EXPERT_STEP_IMBALANCE


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


def memoised(memo: dict[Any, Any] | None, key: tuple[Any, ...], compute: Any) -> Any:
    """memo[key], computed by `compute()` the first time (every call computes without a memo): step_cost's per-search
    store, one model and one hardware per memo."""
    if memo is None:
        return compute()
    value = memo.get(key)
    if value is None:
        value = memo[key] = compute()
    return value
