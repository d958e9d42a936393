"""The planner's entry points: plan a job, resolve its "auto" values, check its catalog names."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from hpctrain.errors import ConfigError, PlanError
from hpctrain.plan.comm import pipeline_outermost
from hpctrain.plan.expert_load import ExpertLoad
from hpctrain.plan.hardware import Hardware, check_catalog_names, precision_problems, resolve_hardware
from hpctrain.plan.lora import fine_tune_notes, lora_shape
from hpctrain.plan.rank_setup import CPU_RUNTIME_OVERHEAD_BYTES, DEFAULT_RUNTIME_OVERHEAD_BYTES, GIB
from hpctrain.plan.model_stats import flops_per_token, model_flops_per_token, param_count
from hpctrain.plan.placement import PlacementPlan, local_gpu_order, rank_order, switches_request
from hpctrain.plan.search import Layout, SearchSettings, optimizer_kind
from hpctrain.plan.split_search import search_with_workers
from hpctrain.plan.space import REASON_UNITS, REASONS, Choices, Rejections
from hpctrain.plan.topology import (
    GpuTopology,
    SwitchTree,
    TopologyParseError,
    parse_nvidia_smi_topo,
    parse_slurm_topology,
)

if TYPE_CHECKING:
    from hpctrain.config import Job


@dataclass
class PlanResult:
    """Ranked feasible layouts (best first), the rejections and what the plan was based on."""

    job_name: str
    model: Any
    hardware: Hardware
    layouts: list[Layout]
    rejected: Rejections
    evaluated: int
    elapsed_s: float
    budget_bytes: float
    gpu_topology: Optional[GpuTopology] = None
    switch_tree: Optional[SwitchTree] = None
    notes: list[str] = field(default_factory=list)
    expert_load: Optional[dict[str, Any]] = None  # MoE: what priced the busiest ep rank (plan/expert_load.py)

    @property
    def best(self) -> Layout:
        return self.layouts[0]

    def placement(self, layout: Optional[Layout] = None) -> PlacementPlan:
        """Placement of a layout (default: the best): stage layers, rank order, --switches."""
        lay = layout or self.best
        hw = self.hardware
        # cp sits between dp and tp in the rank grid (runtime/parallel/dims.py): the placement treats
        # dp x cp as one data-parallel dimension, tp innermost.
        order = rank_order(lay.tp, lay.pp, lay.dp * lay.cp, hw.gpus_per_node, local_gpu_order(hw.gpus_per_node, self.gpu_topology),
                           pipeline_outermost=pipeline_outermost(lay.ep))
        return PlacementPlan([list(r) for r in lay.stage_layers], order, switches_request(hw.nodes, self.switch_tree))

    def to_json(self, top: Optional[int] = None) -> dict[str, Any]:
        """The `hpctrain plan --json` object (and plan.json in a run directory)."""
        from hpctrain.plan.report import advice_json, layout_json

        shown = self.layouts if top is None else self.layouts[:top]
        hw = self.hardware
        return {
            "job": self.job_name,
            "model": {"params": param_count(self.model), "model_flops_per_token": model_flops_per_token(self.model)},
            "cluster": {"gpu": hw.gpu.name, "nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node,
                        "world_size": hw.world_size, "nvlink_island_gpus": hw.nvlink_island_gpus,
                        "nvlink_domain_gpus": hw.nvlink_domain_gpus,
                        "fabric": hw.fabric.name, "memory_budget_gib": round(self.budget_bytes / GIB, 3)},
            "candidates_evaluated": self.evaluated,
            "feasible": len(self.layouts),
            "search_time_s": round(self.elapsed_s, 4),
            "layouts": [layout_json(lay, self.model) for lay in shown],
            "placement": self.placement().to_dict() if self.layouts else None,
            "rejected": self.rejected.to_json(),
            "notes": list(self.notes),
            "expert_load": self.expert_load,
            "advice": advice_json(self) if self.layouts else None,
        }


def _read(path: str, field_path: str) -> str:
    from hpctrain.plan.topology import read_topology_file

    try:
        return read_topology_file(path, field_path)
    except ConfigError as exc:
        raise PlanError(exc.problems) from None


def load_topology(job: Job) -> tuple[Optional[GpuTopology], Optional[SwitchTree]]:
    """Parse the topology files job.cluster.topology names (PlanError naming the field on failure)."""
    topo = job.cluster.topology
    gpu_topology = switch_tree = None
    try:
        if topo.nvidia_smi:
            gpu_topology = parse_nvidia_smi_topo(_read(topo.nvidia_smi, "cluster.topology.nvidia_smi"))
        if topo.slurm_topology:
            switch_tree = parse_slurm_topology(_read(topo.slurm_topology, "cluster.topology.slurm_topology"))
    except TopologyParseError as exc:
        which = "nvidia_smi" if gpu_topology is None and topo.nvidia_smi else "slurm_topology"
        raise PlanError(f"cluster.topology.{which}: {exc}") from None
    if gpu_topology is not None and len(gpu_topology.gpus) != job.cluster.gpus_per_node:
        raise PlanError(f"cluster.topology.nvidia_smi: shows {len(gpu_topology.gpus)} GPUs, but cluster.gpus_per_node="
                        f"{job.cluster.gpus_per_node}; save the file on a node of this cluster or fix gpus_per_node")
    return gpu_topology, switch_tree


def planned_precision(job: Job) -> str:
    """The precision the memory model prices (and the cost model's 16-bit base). fp8 is priced as its high
    precision (bf16 or fp32): the converted linears save their high-precision inputs for backward (torchao's
    Float8Linear recasts them); the fp8 GEMMs and their casts are the cost model's (SearchSettings.fp8,
    kernels.fp8_linears_s)."""
    train = job.train
    return train.fp8.high_precision if train.precision == "fp8" else train.precision


def planned_attention(job: Job) -> str:
    """train.attention_kernel -> cost.ATTENTION_KERNELS: SDPA's math backend materialises the score matrix;
    flash, efficient and auto's choices on a GPU are fused kernels that keep only the log-sum-exp."""
    return "materialized" if job.train.attention_kernel == "math" else "flash"


def plan_job(job: Job, measured: Optional[ExpertLoad] = None, workers: int = 1) -> PlanResult:
    """Search every layout the job allows; PlanError with the reasons when none fits. `measured`: a run's expert
    load (plan/expert_load.py `read_expert_load`), which prices the busiest ep rank instead of the default.
    `workers`: the processes a large search may use (split_search.search_with_workers), the same result."""
    start = time.perf_counter()
    problems = check_catalog_names(job) or precision_problems(job)
    if problems:
        raise PlanError(problems)
    gpu_topology, switch_tree = load_topology(job)
    hw = resolve_hardware(job, gpu_topology.island_size if gpu_topology else None)
    precision = planned_precision(job)
    if hw.gpu.peak_flops_per_s(precision) <= 0:
        raise PlanError(f"train.precision: {hw.gpu.name} has no {precision} tensor cores (got {precision!r}); "
                        "use fp16 (or fp32) on this GPU")
    overhead_gib = job.cluster.runtime_overhead_gib
    default = CPU_RUNTIME_OVERHEAD_BYTES if hw.gpu.name == "cpu" else DEFAULT_RUNTIME_OVERHEAD_BYTES
    overhead = default if overhead_gib is None else overhead_gib * GIB
    moe = job.model.moe if job.model is not None else None
    settings = SearchSettings(global_batch=job.train.global_batch, precision=precision, optimizer=optimizer_kind(job),
                              budget_bytes=float(hw.gpu.memory_bytes), overhead_bytes=overhead,
                              lora=lora_shape(job), attention=planned_attention(job),
                              embedding_on_cpu=bool(job.train.embedding_on_cpu),
                              cp_rotate=job.parallel.cp_rotate,
                              fp8=job.train.precision == "fp8" and not job.train.fp8.emulate, fp8_min_width=int(job.train.fp8.min_width),
                              fp8_recipe=job.train.fp8.recipe,
                              fp8_all_gather=job.train.precision == "fp8" and job.train.fp8.recipe == "tensorwise",
                              memory_fp8_recipe=job.train.fp8.recipe if job.train.precision == "fp8" else None,
                              compile=bool(job.train.compile),
                              expert_load_by_ep=measured.by_ep if measured is not None else ())
    layouts, rejected, evaluated = search_with_workers(job.model, hw, Choices.from_job(job), settings, workers)
    result = PlanResult(job.name, job.model, hw, layouts, rejected, evaluated, time.perf_counter() - start,
                        settings.budget_bytes, gpu_topology, switch_tree)
    result.notes += fine_tune_notes(job, measured is not None)
    if measured is not None:
        result.notes.append(measured.note())
        result.expert_load = measured.to_json()
    elif moe is not None:
        from hpctrain.plan.kernels import DEFAULT_EXPERT_STEP_IMBALANCE
        from hpctrain.plan.expert_load import default_note

        result.notes.append(default_note(DEFAULT_EXPERT_STEP_IMBALANCE))
        result.expert_load = {"source": "default", "step_imbalance": DEFAULT_EXPERT_STEP_IMBALANCE}
    if not layouts:
        raise PlanError(_nothing_fits(job, result))
    return result


def _nothing_fits(job: Job, result: PlanResult) -> list[str]:
    lines = [f"no layout of {job.transformer.layers}-layer model on {result.hardware.world_size} x {result.hardware.gpu.name} "
             f"fits ({result.evaluated} candidates evaluated); reasons:"]
    for reason, count in sorted(result.rejected.counts.items(), key=lambda kv: -kv[1]):
        example = result.rejected.examples[reason][0]
        lines.append(f"  {REASONS[reason]}: {count} {REASON_UNITS[reason]} (e.g. {example})")
    if not result.rejected.counts:
        lines.append("  the fixed values in `parallel:` leave no candidate (tp*pp*dp must equal the GPU count)")
    lines.append("  fix: set more of parallel.* / train.micro_batch / train.activation_checkpointing to auto, "
                 "add nodes, or lower train.global_batch or model.seq_len")
    return lines


def resolve_job(job: Job) -> tuple[Job, PlanResult]:
    """The job with every "auto" filled from the best layout and `placement` set."""
    from hpctrain.config.training import Placement

    result = plan_job(job)
    best = result.best
    parallel = {"tp": best.tp, "pp": best.pp, "dp": best.dp, "cp": best.cp, "ep": best.ep, "zero": best.zero,
                "schedule": "1f1b" if best.schedule == "none" else best.schedule,
                "virtual_stages": best.virtual_stages, "offload_optimizer": best.offload_optimizer}
    if job.parallel.sequence_parallel and best.tp == 1:
        parallel["sequence_parallel"] = False
        result.notes.append("parallel.sequence_parallel set to false: the chosen layout has tp=1")
    train_update: dict[str, Any] = {}
    if job.train.compile and best.tp > 1:
        train_update["compile"] = False  # runtime/parallel/compile.py: tensor-parallel blocks do not compile yet
        result.notes.append(f"train.compile set to false: the chosen layout has tp={best.tp}, and "
                            "tensor-parallel blocks do not compile yet (fix parallel.tp: 1 to keep it)")
    train = {"micro_batch": best.micro_batch, "activation_checkpointing": best.ac, **train_update}
    placement = Placement(**result.placement().to_dict())
    resolved = job.model_copy(update={
        "parallel": job.parallel.model_copy(update=parallel),
        "train": job.train.model_copy(update=train),
        "placement": placement,
    })
    return resolved, result


__all__ = ["PlanResult", "check_catalog_names", "load_topology", "plan_job", "resolve_job", "flops_per_token"]
