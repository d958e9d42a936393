"""The build order, in one place: `build_training(job, device)` -> `Training` (runtime/training.py).

Every rank builds its share of the model in torchtitan's order; each step is one line of
`build_training`, in the order it runs:

    1. meta     the full model on the meta device (no memory)                    model/transformer.py
    2. PP       cut this rank's pipeline stages out of it                        pipeline.py
    2b. FP8     eligible linears -> Float8Linear, MXLinear for mxfp8 (`precision: fp8`) float8.py
    3. TP       tensor parallel (+ sequence parallel, vocab-parallel embedding)  tensor.py
    3b. EP      routed experts split over ep of the dp x cp x tp ranks             expert.py
                (Shard(0) DTensors)
    3c. CP      context parallel: RoPE at global positions, K/V all-gathered       context.py
                (or passed around a ring: parallel.cp_rotate)                     ring_attention.py
                and MoE routing statistics over a micro-batch's cp x tp ranks
    4. LoRA     adapters, after TP (they take the base's placements), before FSDP  model/lora.py
    5. AC       activation checkpointing                                         activation_checkpoint.py
    6. compile  torch.compile per block (`train.compile`), after TP and AC       compile.py
    6b. host    the token embedding kept in host memory (`train.embedding_on_cpu`) host_embedding.py
    7. FSDP2    shard over dp (ZeRO 1-3, optimizer offload); EP's experts over efsdp fsdp.py
                (over the flattened dp x cp, "dp_cp", with context parallelism;
                efsdp = dp x cp x tp / ep)
    8. init     materialise (`to_empty`), build the pipeline schedule over the stages, and fill each
                rank's shards from the seed (model/init.py; not when a checkpoint will be loaded)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.lora import apply_lora
from hpctrain.runtime.model.transformer import ModelArgs, Transformer, build_model
from hpctrain.runtime.parallel.activation_checkpoint import apply_ac
from hpctrain.runtime.parallel.compile import apply_compile
from hpctrain.runtime.parallel.context import ContextParallel, apply_cp, moe_sequence_shards
from hpctrain.runtime.parallel.dims import ParallelDims
from hpctrain.runtime.parallel.expert import apply_ep, sparse_mesh
from hpctrain.runtime.parallel.float8 import apply_float8, compute_precision
from hpctrain.runtime.parallel.fsdp import PARAM_DTYPES, apply_fsdp, zero_stage
from hpctrain.runtime.parallel.grad_norm import norm_weights
from hpctrain.runtime.parallel.host_embedding import HOST, HostEmbedding, host_group, keep_on_host
from hpctrain.runtime.parallel.pipeline import apply_pp, split_model, stage_layer_ranges
from hpctrain.runtime.parallel.precision import LossScaler
from hpctrain.runtime.parallel.tensor import apply_tp
from hpctrain.runtime.training import Training

if TYPE_CHECKING:
    from hpctrain.config import Job
    from hpctrain.config.training import ParallelConfig, TrainConfig


def build_training(job: Job, device: torch.device, initialise: bool = True) -> Training:
    """Build, parallelise and initialise this rank's part of the model from a resolved job.

    initialise=False leaves the parameters unset (a start that loads a checkpoint); call
    `Training.initialise()` if none is loaded after all.

    Needs an initialised default process group when the world size is above 1; a single process
    may run without one (then there is no mesh and no FSDP)."""
    layout = _layout(job, device)
    whole = build_model(layout.args)                                    # 1. meta
    parts = _pipeline_stages(job, layout, whole)                        # 2. PP
    modules = [module for _, module in parts]
    for module in modules:
        _float8(job, layout, module)                                    # 2b. FP8
        _tensor_parallel(job, layout, module)                           # 3. TP
        _expert_parallel(layout, module)                                # 3b. EP
        if layout.context is not None:                                  # 3c. CP
            apply_cp(module, layout.context)
        _lora(job.train, layout, module)                                # 4. LoRA
        apply_ac(module, job.train.activation_checkpointing)            # 5. AC
        if job.train.compile:                                           # 6. compile
            apply_compile(module)
        _host_embedding(job.train, device, module)                      # 6b. host embedding
    _fsdp(job, layout, modules)                                         # 7. FSDP2
    _materialise(job.parallel, device, modules)                         # 8. init: to_empty,
    training = _training(job, device, layout, parts, modules)           #    the schedule,
    if initialise:
        training.initialise()                                           #    the seed's values
    return training


@dataclass(frozen=True)
class _Layout:
    """What the job and the process group say about this rank's share, checked before building."""

    args: ModelArgs
    dims: ParallelDims
    mesh: Any  # DeviceMesh, or None for a single process without a process group
    rank: int
    virtual: int  # pipeline stages per pp rank
    n_microbatches: int
    fsdp: bool
    experts_mesh: Any = None  # ("efsdp", "ep") over this stage's dp x cp x tp ranks when parallel.ep > 1
    context: ContextParallel | None = None  # parallel.cp > 1: this rank's place in its cp group
    fsdp_mesh: Any = None  # what FSDP shards over: "dp", or the flattened "dp_cp" with context parallelism


def _layout(job: Job, device: torch.device) -> _Layout:
    args = ModelArgs.from_config(job.model)
    initialised = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialised else 1
    rank = dist.get_rank() if initialised else 0
    par = job.parallel
    if job.train.compile and isinstance(par.tp, int) and par.tp > 1:  # validate and plan catch it first
        raise ConfigError(f"train.compile: does not combine with tensor parallel yet (parallel.tp={par.tp}); "
                          "set train.compile: false, or parallel.tp: 1 (runtime/parallel/compile.py)")
    dims = ParallelDims.from_job(job, world_size)
    virtual = par.virtual_stages if dims.pp_enabled else 1
    if not isinstance(virtual, int) or virtual < 1:
        raise ConfigError(f"parallel.virtual_stages: got {virtual!r}; must be an integer >= 1")
    dims.validate_model(args, virtual)
    n_micro = _micro_batches(job.train, dims)
    fsdp = dims.dp_cp > 1 or bool(par.offload_optimizer)  # cp ranks hold the same weights: FSDP reduces over them
    if fsdp and not initialised:
        raise ConfigError("parallel.offload_optimizer: needs a process group (run through the runtime entry point)")
    mesh = dims.build_mesh(device.type) if initialised else None
    if dims.world_size > 1 or fsdp:
        assert mesh is not None  # world_size > 1 implies an initialised group; fsdp checked above
    experts_mesh = sparse_mesh(mesh, dims.ep) if dims.ep_enabled and mesh is not None else None
    context, fsdp_mesh = None, (mesh["dp"] if mesh is not None else None)
    if dims.cp_enabled:
        assert mesh is not None  # cp > 1 means world_size > 1: an initialised group
        cp_mesh = mesh["cp"]
        moe_shards = moe_sequence_shards(mesh, args.seq_len) if args.moe is not None else None
        context = ContextParallel(cp_mesh.get_group(), dims.cp, cp_mesh.get_local_rank(), args.seq_len,
                                  par.cp_rotate, moe_shards)
        fsdp_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # torchtitan's dp_shard_cp
    return _Layout(args, dims, mesh, rank, virtual, n_micro, fsdp, experts_mesh, context, fsdp_mesh)


def _micro_batches(train: TrainConfig, dims: ParallelDims) -> int:
    if train.global_batch % dims.dp:
        raise ConfigError(
            f"train.global_batch: got {train.global_batch}; must be divisible by parallel.dp={dims.dp}"
        )
    local = train.global_batch // dims.dp
    micro = train.micro_batch
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1 or local % micro:
        raise ConfigError(
            f"train.micro_batch: got {micro!r}; must be a positive integer dividing the per-dp-rank "
            f"batch global_batch/dp = {local} (resolve 'auto' with `hpctrain plan`)"
        )
    return local // micro


def _pipeline_stages(job: Job, layout: _Layout, whole: Transformer) -> list[tuple[int, Transformer]]:
    """(stage index, module) of this rank's stages: the whole model without pipelining."""
    if not layout.dims.pp_enabled:
        return [(0, whole)]
    pp_rank = layout.mesh.get_local_rank("pp") if layout.mesh is not None else 0
    ranges = stage_layer_ranges(job, layout.dims.pp, layout.virtual)
    return split_model(whole, ranges, pp_rank, layout.dims.pp)


def _float8(job: Job, layout: _Layout, module: Transformer) -> None:
    if job.train.precision == "fp8":  # before TP and FSDP: their styles and units see Float8Linear
        apply_float8(module, job.train.fp8, fsdp=layout.fsdp, tp=layout.dims.tp)


def _tensor_parallel(job: Job, layout: _Layout, module: Transformer) -> None:
    if layout.dims.tp_enabled:
        assert layout.mesh is not None
        train = job.train
        apply_tp(module, layout.mesh["tp"], sequence_parallel=bool(job.parallel.sequence_parallel),
                 loss_parallel=True, float8_tensorwise=train.precision == "fp8" and train.fp8.recipe == "tensorwise")


def _host_embedding(train: TrainConfig, device: torch.device, module: Transformer) -> None:
    if train.embedding_on_cpu and module.tok_embeddings is not None:
        dtype = PARAM_DTYPES[compute_precision(train)]
        keep_on_host(module.tok_embeddings, device, dtype)


def _expert_parallel(layout: _Layout, module: Transformer) -> None:
    if layout.experts_mesh is not None:  # after TP, before FSDP (runtime/parallel/expert.py)
        apply_ep([module], layout.experts_mesh["ep"])


def _lora(train: TrainConfig, layout: _Layout, module: Transformer) -> None:
    if train.lora is not None:  # after TP (the adapters take the base's placements), before FSDP
        tp_mesh = layout.mesh["tp"] if layout.dims.tp_enabled and layout.mesh is not None else None
        apply_lora(module, train.lora, tp_mesh)


def _fsdp(job: Job, layout: _Layout, modules: list[Transformer]) -> None:
    if layout.fsdp:
        assert layout.mesh is not None
        apply_fsdp(
            modules,
            layout.fsdp_mesh,
            zero=zero_stage(job.parallel),
            precision=compute_precision(job.train),
            offload_optimizer=bool(job.parallel.offload_optimizer),
            pipelined=layout.dims.pp_enabled,
            experts_mesh=layout.experts_mesh["efsdp"] if layout.experts_mesh is not None else None,
            host_embedding=bool(job.train.embedding_on_cpu),
        )


def _materialise(parallel: ParallelConfig, device: torch.device, modules: list[Transformer]) -> None:
    """Real (uninitialised) storage for each rank's shards; rope tables and buffers on the device."""
    init_device = torch.device("cpu") if parallel.offload_optimizer else device
    for module in modules:
        host = module.tok_embeddings if isinstance(module.tok_embeddings, HostEmbedding) else None
        if host is None:
            module.to_empty(device=init_device)
        else:  # train.embedding_on_cpu: the table is allocated on the host only, never on the device
            for child in module.children():
                child.to_empty(device=HOST if child is host else init_device)
            module.to_empty(device=init_device, recurse=False)
        module.tie_weights()
        module.rope_cos.data = module.rope_cos.data.to(device)
        module.rope_sin.data = module.rope_sin.data.to(device)
        module.init_buffers()


def _training(job: Job, device: torch.device, layout: _Layout, parts: list[tuple[int, Transformer]],
              modules: list[Transformer]) -> Training:
    """The `Training` over the built modules, with its pipeline schedule and tied-embedding group."""
    dims, mesh = layout.dims, layout.mesh
    training = Training(
        job=job,
        args=layout.args,
        dims=dims,
        mesh=mesh,
        device=device,
        model_parts=modules,
        schedule=None,
        n_microbatches=layout.n_microbatches,
        has_first_stage=any(m.tok_embeddings is not None for m in modules),
        has_last_stage=any(m.output is not None for m in modules),
        loss_scaler=LossScaler(device) if job.train.precision == "fp16" else None,
        fsdp=layout.fsdp,
        # torchao's fp8 all-gather needs each weight's scale after the optimizer step (float8.py).
        float8_scales=job.train.precision == "fp8" and job.train.fp8.recipe == "tensorwise" and layout.fsdp,
    )
    if job.train.embedding_on_cpu and dims.dp_enabled:  # every rank: creating a group is collective
        assert mesh is not None
        training.host_embedding_group = host_group(mesh)
    if dims.pp_enabled:
        assert mesh is not None
        if layout.args.tie_embeddings:
            training.tied_group = _tied_group(mesh, layout.rank)
        training.schedule = apply_pp(parts, mesh["pp"], device, schedule=job.parallel.schedule,
                                     n_microbatches=layout.n_microbatches, loss_fn=training._loss_fn)
    training._norm_weights = norm_weights(training.model_parts, dims.dp * dims.cp * dims.tp,
                                          training.tied_group is not None)
    return training


def _tied_group(mesh: Any, rank: int) -> Any:
    """A group {first-stage rank, last-stage rank} per (dp, [cp,] tp) slot; every rank creates all."""
    grid = mesh.mesh
    mine = None
    for first, last in zip(grid[0].flatten().tolist(), grid[-1].flatten().tolist()):
        pair = [int(first), int(last)]
        group = dist.new_group(pair)
        if rank in pair:
            mine = group
    return mine
