"""What the memory model takes and gives: `RankSetup` (one layout, as memory sees it) and `MemoryBreakdown` (bytes
per component at a rank's peak phase, with the items that make each up: ITEM_COMPONENTS), and the runtime's
overhead beside them. plan/memory.py computes a MemoryBreakdown from a RankSetup; plan/states.py counts its
parameter-sized buffers; plan/search.py builds the setups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.plan.activations import DEFAULT_EXPERT_LOAD_IMBALANCE
from hpctrain.plan.lora import LoraShape

GIB = 2**30
# CUDA context + cuBLAS/cuDNN workspaces + NCCL buffers + allocator fragmentation, per GPU, when the
# job does not set cluster.runtime_overhead_gib. None of it is in torch.cuda.memory_allocated: a CUDA
# context with lazy module loading takes ~300 MB (pytorch issue #107667, a maintainer's figure) and
# each NCCL communicator 544-688 MB on 4 A100s (NVIDIA/nccl issue #964); a rank of a tp x pp x dp
# layout joins about three (its tp, pp and dp groups), ~2 GB in all; fragmentation adds a few percent.
DEFAULT_RUNTIME_OVERHEAD_BYTES = 2 * GIB
CPU_RUNTIME_OVERHEAD_BYTES = GIB // 4  # a local CPU process: the interpreter, torch and gloo buffers


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
    # The runtime's AdamW runs torch's fused kernel (runtime/optim.py: no temporary) except over torchao's fp8
    # weight wrappers (fp8 tensorwise under FSDP), where it runs the foreach kernels: a temporary the size of the
    # rank's gradients (torch/optim/adamw.py _multi_tensor_adamw, its _foreach_sqrt of the second moments).
    foreach: bool = False
    overhead_bytes: float = DEFAULT_RUNTIME_OVERHEAD_BYTES
    lora: LoraShape | None = None  # train.lora: only the adapters train (plan/lora.py)
    attention: str = "flash"  # cost.ATTENTION_KERNELS; "materialized" keeps the score matrix
    embedding_on_cpu: bool = False  # train.embedding_on_cpu: the first stage's table, grad, states in host memory
    cp: int = 1  # parallel.cp: each rank holds seq_len / cp tokens; FSDP shards over dp x cp (plan/context.py)
    cpu_attention: bool = False  # planning for `gpu: cpu`: SDPA materialises context parallelism's causal masks
    cp_rank: int | None = None  # the context-parallel rank to account (None: the most loaded)
    cp_rotate: str = "allgather"  # parallel.cp_rotate: allgather holds the whole sequence's K/V, ring a pair in flight

    @property
    def fsdp(self) -> bool:
        """Whether the runtime shards with FSDP: over dp x cp ranks, or to offload the optimizer."""
        return self.dp * self.cp > 1 or self.offload_optimizer
    ep: int = 1  # parallel.ep: routed experts split over ep ranks, FSDP-sharded over efsdp (runtime/parallel/expert.py)
    expert_load_imbalance: float = DEFAULT_EXPERT_LOAD_IMBALANCE  # received rows / mean under ep (activations.py)
    # train.precision fp8 (emulated or not): the recipe and min_width that pick the converted linears
    # (activations.fp8_linear_params_per_layer); None otherwise. `precision` is then fp8's high precision.
    fp8_recipe: str | None = None
    fp8_min_width: int = 1024

    @property
    def efsdp(self) -> int:
        """The routed experts' FSDP degree: the dp x cp x tp ranks of a stage over ep (torchtitan's ParallelDims:
        the sparse region efsdp x ep spans the dense region's dp x cp x tp ranks; runtime/parallel/dims.py)."""
        return max(1, self.dp * self.cp * self.tp // self.ep)


# Item names of the breakdown, with the component each belongs to.
ITEM_COMPONENTS: dict[str, str] = {
    "fp32 master weights": "weights",
    "unsharded compute weights (FSDP)": "weights",
    "RoPE tables": "weights",
    "gradients": "grads",
    "unsharded fp32 gradient accumulation (FSDP, deferred reduce-scatter)": "grads",
    "optimizer states": "optimizer",
    "saved activations": "activations",
    "autocast weight copies": "activations",
    "pipeline stage buffers": "activations",
    "recompute of one layer (activation checkpointing)": "activations",
    "loss gradient buffers": "other",
    "backward gradient buffers": "other",
    "gradient reduce-scatter buffer (FSDP)": "other",
    "foreach optimizer temporary": "other",
    "runtime overhead (CUDA context, allocator)": "other",
}
