"""The `train:`, `parallel:` and `placement:` sections."""

from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union

from pydantic import Field

from hpctrain.config import limits as L
from hpctrain.config.base import Section, new_list
from hpctrain.config.lazy import LazySection
from hpctrain.config.types import Text, ZeroStage, auto_int

# Integers or "auto" within their bounds: pydantic types built at run time (types.auto_int); mypy sees the
# values they hold.
if TYPE_CHECKING:
    from hpctrain.config.lora import LoraConfig as LoraSection
    MicroBatch = Union[int, str]
    TpDegree = Union[int, str]
    PpDegree = Union[int, str]
    DpDegree = Union[int, str]
    VirtualStages = Union[int, str]
    EpDegree = Union[int, str]
else:
    MicroBatch = auto_int(1, L.MAX_MICRO_BATCH)
    TpDegree = auto_int(1, L.MAX_GPUS_PER_NODE)
    PpDegree = auto_int(1, L.MAX_LAYERS)
    DpDegree = auto_int(1, L.MAX_WORLD)
    VirtualStages = auto_int(1, L.MAX_LAYERS)
    EpDegree = auto_int(1, L.MAX_WORLD)
    LoraSection = Annotated[Any, LazySection("hpctrain.config.lora", "LoraConfig")]  # config/lazy.py


class OptimizerConfig(Section):
    """The optimizer. AdamW keeps two fp32 moments per parameter; SGD (momentum optional) is for tests."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(3e-4, gt=0, le=10, description="Peak learning rate.")
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field([0.9, 0.95], min_length=2, max_length=2, description="AdamW betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, le=1, description="AdamW epsilon.")
    weight_decay: float = Field(0.1, ge=0, le=100, description="Decoupled weight decay.")
    grad_clip: Optional[float] = Field(1.0, gt=0, le=1e9, description="Clip the global gradient norm to this; null disables.")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum.")


class LRSchedule(Section):
    """Linear warm-up, then cosine / linear decay to min_lr_ratio × lr, or constant."""

    kind: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    warmup_steps: int = Field(0, ge=0, le=L.MAX_STEPS, description="Steps of linear warm-up from 0 to lr.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of lr.")


class Fp8Config(Section):
    """torchao's float8 training (`train.precision: fp8`): the eligible linear layers compute their GEMMs in fp8
    with dynamic scales; everything else (the output head, the MoE router, layers narrower than min_width, the
    attention core, norms) runs in `high_precision`. Master weights stay fp32."""

    recipe: Literal["tensorwise", "rowwise", "mxfp8"] = Field(
        "tensorwise", description="The FP8 recipe: torchao's float8 with one scale per tensor (FSDP2 all-gathers the "
        "weights in fp8) or one per row (more accurate, weights all-gathered in 16 bits); or mxfp8, Blackwell's "
        "microscaled FP8 (OCP MX: e4m3 in blocks of 32 along each GEMM's reduction, one power-of-two E8M0 scale per "
        "block; weights all-gathered in 16 bits): needs MX tensor cores (B200, B300, GB200, GB300) unless emulated, "
        "and widths and model.seq_len / parallel.cp in multiples of 32.")
    # torchao's own auto-filter (float8_linear_utils._auto_filter_for_tensorwise) skips tensorwise layers with
    # K <= 4096 and N <= 1024 from its H100 table; one width bound is simpler to state: 1024 by default.
    min_width: int = Field(1024, ge=16, le=L.MAX_HIDDEN, description="Default 1024. Convert a linear layer only if both its "
                           "input and output widths are at least this (and multiples of 16, the fp8 GEMM's tile): "
                           "smaller GEMMs lose more to the casts than fp8 gains.")
    emulate: bool = Field(False, description="torchao's emulation: fp8 casts with 16/32-bit GEMMs, on any device "
                          "(tests and CPU checks; slower than bf16). Never chosen silently.")
    high_precision: Literal["bf16", "fp32"] = Field("bf16", description="Precision of what stays out of fp8 "
                                                    "(bf16 as torchtitan; fp32 for exact layout-parity checks).")


class TrainConfig(Section):
    """What to train and how: batch, steps, precision, optimizer, data."""

    global_batch: int = Field(8, ge=1, le=L.MAX_GLOBAL_BATCH, description="Sequences per optimizer step, over all data-parallel ranks.")
    micro_batch: MicroBatch = Field("auto", description="Sequences per forward pass per rank, or auto.")
    steps: int = Field(100, ge=1, le=L.MAX_STEPS, description="Optimizer steps to run.")
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = Field("bf16", description="Compute precision (master weights "
                                                              "fp32); fp8: torchao's float8 linears (train.fp8).")
    fp8: Fp8Config = Field(default_factory=lambda: Fp8Config(),
                           description="FP8 training settings (train.precision: fp8).")
    embedding_on_cpu: bool = Field(False, description="Keep the token embedding, its gradient and its optimizer "
                                   "state in host memory; only the lookup's output moves to the device. Not with "
                                   "parallel.tp > 1 or model.tie_embeddings.")
    attention_kernel: Literal["auto", "flash", "efficient", "math"] = Field(
        "auto", description="SDPA backend: auto (torch picks), flash, efficient (memory-efficient) or math "
        "(materialises the score matrix; the planner's 'materialized' cost).")
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(), description="Optimizer settings.")
    lr_schedule: LRSchedule = Field(default_factory=lambda: LRSchedule(), description="Learning-rate schedule.")
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = Field(
        "auto", description="Recompute activations in backward: none, selective (attention core), full (whole block)."
    )
    compile: bool = Field(False, description="Compile each transformer block with torch.compile (inductor); "
                          "the first step pays the compilation.")
    data: Text = Field("synthetic", description="'synthetic', or a flat token file from `hpctrain data prepare`.")
    data_dtype: Literal["auto", "uint16", "uint32"] = Field("auto", description="Token file element type.")
    eval_data: Optional[Text] = Field(None, description="Validation token file; default: the "
                                     "validation file `data prepare --val-fraction` wrote beside train.data, if any.")
    eval_every: int = Field(0, ge=0, le=L.MAX_STEPS, description="Compute the validation loss every N steps (and at the end); 0 = never.")
    eval_batches: int = Field(4, ge=1, le=L.MAX_GLOBAL_BATCH, description="Global batches per validation (the same ones every time).")
    seed: int = Field(1234, ge=0, le=L.MAX_SEED, description="Seed for weights, data and dropout.")
    log_every: int = Field(1, ge=1, le=L.MAX_STEPS, description="Write a metrics line every N steps.")
    lora: Optional[LoraSection] = Field(None, description="Train low-rank adapters on a frozen base (LoRA); "
                                       "null trains every weight.")


class ParallelConfig(Section):
    """The layout: tensor (tp), pipeline (pp), data (dp), context (cp) and expert (ep) parallel degrees and how each runs."""

    tp: TpDegree = Field("auto", description="Tensor-parallel degree (kept inside an NVLink island).")
    pp: PpDegree = Field("auto", description="Pipeline-parallel degree (stages).")
    dp: DpDegree = Field("auto", description="Data-parallel degree (FSDP2 replicas/shards).")
    ep: EpDegree = Field(1, description="Expert-parallel degree (model.moe): the routed experts "
                         "are split over ep of the dp x cp x tp ranks (ep consecutive ranks, tp innermost), tokens reach them by "
                         "all-to-all; must divide dp x cp x tp and the experts, and be a multiple of tp; auto: the planner "
                         "picks it (1 without model.moe).")
    cp: int = Field(1, ge=1, le=L.MAX_WORLD, description="Context-parallel degree: every sequence split over cp ranks "
                    "(a head chunk and its mirror tail chunk each, for a causal balance); attention reaches the other ranks' "
                    "K/V by parallel.cp_rotate; weights are sharded over dp x cp (runtime/parallel/context.py). seq_len must be a multiple of 2 x cp.")
    cp_rotate: Literal["allgather", "ring"] = Field("allgather", description="How context parallelism's attention "
                    "reaches the other cp ranks' K/V: allgather (one all-gather per layer; holds the whole sequence's "
                    "K/V per layer) or ring (cp-1 point-to-point rotations of one K/V chunk pair, each overlapped with "
                    "a block's attention; holds the local chunks and one pair in flight: less memory, the same bytes "
                    "sent, exposed only where a transfer outlasts its block) (runtime/parallel/ring_attention.py).")
    schedule: Literal["auto", "gpipe", "1f1b", "interleaved-1f1b"] = Field("auto", description="Pipeline schedule.")
    virtual_stages: VirtualStages = Field("auto", description="Model chunks per pipeline rank (interleaved-1f1b).")
    zero: ZeroStage = Field("auto", description="ZeRO stage over dp: 0/1/2 keep params unsharded in compute, 3 reshards.")
    sequence_parallel: bool = Field(False, description="Shard norm/dropout activations over tp (needs tp > 1).")
    offload_optimizer: bool = Field(False, description="Keep optimizer states and the step on the CPU.")


class Placement(Section):
    """Filled by the planner in the resolved job: where each layer and rank goes."""

    stage_layers: list[Annotated[list[Annotated[int, Field(ge=0, le=L.MAX_LAYERS)]], Field(min_length=2, max_length=2)]] = Field(
        default_factory=new_list, max_length=L.MAX_LAYERS, description="[first, end) layer range per virtual stage, in pipeline order."
    )
    rank_order: Optional[list[Annotated[int, Field(ge=0, lt=L.MAX_WORLD)]]] = Field(None, max_length=L.MAX_WORLD, description="Global rank -> slot order (tp innermost).")
    switches: Optional[int] = Field(None, ge=1, le=L.MAX_NODES, description="sbatch --switches request, when one leaf fits the job.")
