"""The planner against published training runs: layout rank, throughput and memory (issue 13 item 5).

    python bench/planner_accuracy.py [--only NAME ...] [--fit] [--corpus PATH]

The corpus (bench/data/published_runs.yaml) lists each run with its source, its published layout and
its published throughput in the publisher's own unit, and what the publisher's software had (its
attention kernel: runs before FlashAttention materialise the score matrix, cost.py "materialized";
its recomputation modes, `ac_modes`), split up front into a calibration and a validation set (by
source; the file's header says how). For each run:
- rank: where the published (tp, pp) family lands in the planner's full search over the publisher's
  recomputation modes (families ordered by their best layout; "-" when the planner finds that
  family infeasible, with its reason);
- predicted vs published throughput: the planner's best layout within the published layout (the
  fields the source fixes are fixed, the rest searched; one over the memory budget is still costed
  and marked "over"), converted to the publisher's unit with the publisher's FLOP formula;
- predicted memory of that layout, beside the published figure where there is one.
A run the planner cannot cost (an unknown catalog name, an impossible layout) is printed as NOT
COSTED and counts as a miss in every figure.
Then one summary line per set: published (tp, pp) in the top 5 (layout cases), throughput within
+-15 %, median absolute throughput error; the same per category of each set (dense, MoE, CP, FP8: a row
counts in each category it has, e.g. a CP run in FP8 in both; dense = none of the others); and, for every
table (corpus field `table`) with >= 3 layouts of one model on one cluster, Kendall's tau between the
published and the predicted order and whether the published best is in the planner's top 3 of the table.
Per run, what the publisher's software did is in its fields: `precision` (fp8 with `fp8_recipe`), `fused`
(element-wise work fused: torch.compile, or Transformer Engine's fused kernels; under TP too), `one_nic_collectives`
(the publisher's cross-node collectives ran at one NIC per member, not spread over its members' NICs in a node as
NCCL's channels do: comm.group_link), and
`expert_load_imbalance` (1.0 where the publisher forced balanced routing), `selective_mm_recompute` (the share
of forward matmuls the publisher's selective policy replays; cost_setup.CostSetup) and `a2a_overlap` (expert
all-to-alls beside another micro-batch's compute: Megatron-Core's moe_a2a_overlap) and `cp_repeated_kv` (torch's
context_parallel around a model that repeats K/V to the query heads before SDPA: torchtitan's Llama), `cp_rotate`
(allgather, the default, or ring: Megatron-Core / Transformer Engine's point-to-point context parallelism, K/V chunks
passed around the cp ring beside the attention blocks; parallel.cp_rotate, plan/context.py), `stack` (torch,
the default, or megatron-te: Megatron-Core with Transformer Engine; hardware.STACKS) with `te_attention` (fused:
cuDNN's attention, the default; flash: flash-attn's FlashAttention-2, where the run set NVTE_FUSED_ATTN=0;
hardware.TE_ATTENTION_BACKENDS) and `dispatcher` (alltoall,
deepep, hybridep; cost_setup.CostSetup), `token_drop` (capacity-factor dropping with expert inputs padded to capacity)
and `cuda_graph` (full_iteration: the whole step replayed from a CUDA graph, the MoE blocks sync-free): with
either, a MoE block never waits for its routing sizes on the host, else Megatron-Core's dropless MoE always does
(moe_cost.MOE_SYNC_HOST_S; `moe_sync`); `cuda_graph: layers` (Transformer Engine's per-layer graphs of a block's dense
parts, Megatron-Core's cuda_graph_impl transformer_engine with any cuda_graph_scope of attn, moe_router and
moe_preprocess) spares an FP8 run's MoE blocks the eager launches after each sync (moe_cost.MOE_EAGER_HOST_S), and
`moe_recompute` (Megatron-Core's "moe" recompute module beside ac selective: the whole MoE block's forward,
all-to-alls included, replayed in the backward). The publisher's FLOP formulas (`metric.flops`): megatron_hfu,
megatron_mfu, palm, megatron (Megatron-LM's of 2025, for GQA and MoE: causal halving of the scores) and megatron_2024
(the same function as Megatron-LM had it from 2024-04 to 2025-03: the full s x s score matrix counted). `--fit` fits
the GEMM efficiency per (GPU, stack) on the calibration set only (hardware.py cites the result; a stack fitted on FP8
runs no faster than cuBLASLt alone measures, hardware.FP8_GEMM_MEASURED_TFLOPS) and reports both sets with the
fitted values. Torch-free.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).resolve().parent / "data" / "published_runs.yaml"
TOP = 5
TOLERANCE = 0.15
GIB = 2**30
TIME_UNITS = ("step_time_s",)


@dataclass(frozen=True)
class Outcome:
    """What the bench found for one corpus run."""

    name: str
    set: str
    layout_case: bool
    rank: Optional[int]  # of the published (tp, pp) family; None when infeasible
    rank_note: str  # the planner's best layout, or why the published family is infeasible
    unit: str
    published: float
    predicted: float
    layout: str  # the costed layout within the published one
    fits: bool
    memory_gib: float
    published_memory_gib: Optional[float]
    failure: str = ""  # why the run could not be costed (it then counts as a miss everywhere)

    @property
    def error(self) -> float:
        """Predicted / published - 1 in throughput terms (the same ratio as tokens/s): for a time
        unit (step_time_s) that is published / predicted - 1."""
        if self.failure:
            return float("inf")
        if self.unit in TIME_UNITS:
            return self.published / self.predicted - 1
        return self.predicted / self.published - 1


def load_corpus(path: Path = CORPUS) -> list[dict[str, Any]]:
    import yaml

    runs = yaml.safe_load(path.read_text())["runs"]
    for run in runs:
        if run["set"] not in ("calibration", "validation"):
            raise SystemExit(f"{path}: run {run['name']!r}: set must be calibration or validation (got {run['set']!r})")
    return runs


def _job(run: dict[str, Any], fixed: bool) -> Any:
    """The hpctrain job of a corpus run: everything auto, or the published layout's fields fixed."""
    from hpctrain.config import job_from_dict
    from hpctrain.plan.hardware import NODES

    hw, lay = run["hardware"], run["layout"]
    # GPUs per node: the row's, else its node profile's (4 on a GB200 / GB300 NVL72 compute tray), else 8
    per_node = hw.get("gpus_per_node") or (NODES[hw["node"]].gpus_per_node if hw.get("node") in NODES else 8)
    moe = run["model"].get("moe") is not None
    parallel: dict[str, Any] = {"tp": "auto", "pp": "auto", "dp": "auto", "schedule": "auto",
                                "virtual_stages": "auto", "zero": "auto", "offload_optimizer": False,
                                # MoE with tp > 1 needs SP (the experts are not tensor-parallel): on unless tp is 1
                                "sequence_parallel": bool(lay.get("sequence_parallel", False)
                                                          or (moe and not (fixed and lay.get("tp") == 1))),
                                "ep": "auto" if moe else 1}
    train: dict[str, Any] = {"global_batch": run["global_batch"], "micro_batch": "auto",
                             "activation_checkpointing": "auto", "precision": run.get("precision", "bf16")}
    if run.get("precision") == "fp8":
        train["fp8"] = {"recipe": run.get("fp8_recipe", "tensorwise")}
    if fixed:
        for key in ("tp", "pp", "dp", "zero", "schedule", "virtual_stages", "cp", "ep"):
            if lay.get(key) is not None:
                parallel[key] = lay[key]
        if lay.get("micro_batch") is not None:
            train["micro_batch"] = lay["micro_batch"]
        if lay.get("ac") is not None:
            train["activation_checkpointing"] = lay["ac"]
    cluster = {"nodes": hw["gpus"] // per_node, "gpus_per_node": per_node, "gpu": hw["gpu"], "fabric": hw["fabric"]}
    if hw.get("node"):
        cluster["node"] = hw["node"]
    if hw.get("nvlink_domain_gpus"):  # the publisher's allocation per NVLink domain (e.g. 64 of an NVL72 rack)
        cluster["nvlink_domain_gpus"] = hw["nvlink_domain_gpus"]
    return job_from_dict({"name": run["name"], "model": dict(run["model"]), "train": train, "parallel": parallel,
                          "cluster": cluster})


def _stack(run: Optional[dict[str, Any]]) -> str:
    """The publisher's software family (corpus field `stack`, default torch; hardware.STACKS)."""
    from hpctrain.plan.hardware import STACKS

    stack = (run or {}).get("stack", "torch")
    if stack not in STACKS:
        raise SystemExit(f"run {(run or {}).get('name')!r}: stack must be one of {', '.join(STACKS)} (got {stack!r})")
    return str(stack)


def _hardware(job: Any, gemm_efficiency: Optional[dict[tuple[str, str], float]], run: Optional[dict[str, Any]] = None
              ) -> Any:
    """The run's hardware as its publisher's software stack runs it; `gemm_efficiency` (the fit) per (GPU, stack)."""
    from hpctrain.plan.hardware import resolve_hardware, with_stack

    hw = resolve_hardware(job)
    if (run or {}).get("one_nic_collectives"):  # the publisher's collectives ran at one NIC per member (comm.py)
        hw = replace(hw, nic_aggregation=False)
    stack = _stack(run)
    return with_stack(hw, stack, (gemm_efficiency or {}).get((hw.gpu.name, stack)), _te_attention(run))


def _te_attention(run: Optional[dict[str, Any]]) -> str:
    """Transformer Engine's attention backend in the publisher's run (corpus field `te_attention`, default fused:
    cuDNN's; flash where the run set NVTE_FUSED_ATTN=0; hardware.TE_ATTENTION_BACKENDS). Only megatron-te rows."""
    from hpctrain.plan.hardware import TE_ATTENTION_BACKENDS

    run = run or {}
    backend = run.get("te_attention", "fused")
    if backend not in TE_ATTENTION_BACKENDS:
        raise SystemExit(f"run {run.get('name')!r}: te_attention must be one of "
                         f"{', '.join(TE_ATTENTION_BACKENDS)} (got {backend!r})")
    if "te_attention" in run and _stack(run) != "megatron-te":
        raise SystemExit(f"run {run.get('name')!r}: te_attention applies to stack megatron-te only")
    return str(backend)


def _search(job: Any, hw: Any, budget_bytes: Optional[float] = None, run: Optional[dict[str, Any]] = None
            ) -> tuple[list[Any], Any]:
    from hpctrain.plan.rank_setup import DEFAULT_RUNTIME_OVERHEAD_BYTES
    from hpctrain.plan.planner import planned_precision
    from hpctrain.plan.search import SearchSettings, optimizer_kind, search
    from hpctrain.plan.space import Choices

    fused = bool(run.get("fused", False)) if run else False
    settings = SearchSettings(global_batch=job.train.global_batch, precision=planned_precision(job),
                              optimizer=optimizer_kind(job),
                              budget_bytes=float(hw.gpu.memory_bytes) if budget_bytes is None else budget_bytes,
                              overhead_bytes=DEFAULT_RUNTIME_OVERHEAD_BYTES,
                              attention=_attention(run) if run else "flash",
                              fp8=job.train.precision == "fp8", fp8_min_width=int(job.train.fp8.min_width),
                              fp8_recipe=job.train.fp8.recipe,
                              compile=fused, compile_with_tp=fused,
                              expert_load_imbalance=run.get("expert_load_imbalance") if run else None,
                              selective_mm_recompute=float(run.get("selective_mm_recompute", 0.0)) if run else 0.0,
                              a2a_overlap=bool(run.get("a2a_overlap", False)) if run else False,
                              cp_repeated_kv=bool(run.get("cp_repeated_kv", False)) if run else False,
                              dispatcher=_dispatcher(run) if run else "alltoall",
                              cp_rotate=_cp_rotate(run) if run else "allgather",
                              tp_overlap=bool(run.get("tp_overlap", False)) if run else False,
                              stage_split=_stage_split(run) if run else "balanced",
                              # Megatron-Core's distributed optimizer: gradients and parameters once per step
                              dp_once_per_step=bool(run and _stack(run) == "megatron-te"),
                              moe_sync=_moe_sync(run) if run else "ep",
                              moe_recompute=bool(run.get("moe_recompute", False)) if run else False,
                              layer_graphs=_cuda_graph(run) == "layers" if run else False,
                              # Transformer Engine's grouped linear runs the routed experts in FP8 too
                              fp8_experts=bool(run and _stack(run) == "megatron-te" and job.train.precision == "fp8"))
    choices = Choices.from_job(job)
    if run and run.get("ac_modes") and len(choices.ac) > 1:  # the publisher's software's recomputation modes
        choices = replace(choices, ac=tuple(m for m in choices.ac if m in run["ac_modes"]))
    layouts, rejected, _ = search(job.model, hw, choices, settings)
    return layouts, rejected


def publisher_flops_per_token(model: Any, formula: str) -> float:
    """FLOPs per token by the publisher's own formula (see the corpus header)."""
    from hpctrain.plan.model_stats import param_count

    layers, hidden, seq, vocab = model.layers, model.hidden, model.seq_len, model.vocab
    if formula == "megatron_hfu":  # Narayanan et al. 2021, eq. 3, per token
        return 96.0 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    if formula == "megatron_mfu":  # Korthikanti et al. 2022, section 6 (model FLOPs)
        return 72.0 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    if formula == "palm":  # Chowdhery et al. 2022, appendix B
        return 6.0 * param_count(model) + 12.0 * layers * hidden * seq
    if formula == "megatron":  # Megatron-LM's num_floating_point_operations (2025 form), per token
        return _megatron_flops_per_token(model)
    if formula == "megatron_2024":  # the same before 2025-03-06: no causal halving, every layer MoE
        return _megatron_flops_per_token(model, causal=False)
    raise SystemExit(f"unknown FLOP formula {formula!r}; known: megatron_hfu, megatron_mfu, palm, megatron, "
                     "megatron_2024")


def _megatron_flops_per_token(model: Any, causal: bool = True) -> float:
    """Megatron-LM megatron/training/training.py `num_floating_point_operations` / (batch x seq), the form of
    2025-03 on (commit 8873b55, "Fixes in number of floating-point operation estimates for MoE and attention
    layer": causal halving of the scores, dense and MoE blocks apart; refactored in 2026 into token-linear and
    core-attention parts with the same value for unpacked sequences), which Megatron-Bridge's
    src/megatron/bridge/training/utils/flop_utils.py repeats for its "Model TFLOP/sec/GPU" column and
    Megatron-LM's --log-throughput prints (Megatron-MoE-ModelZoo's TFLOPS):
      12 l h [ffn g (dense share) + expert_ffn k g (MoE share) + shared_ffn g (MoE share)]
      + 12 l h^2 (1 + kv_heads/heads + s/(2h)) (heads head_dim / h)   (the s/2h term: causal, half the scores)
      + 6 h V
    with 12 = 3 GEMMs (fwd, dgrad, wgrad) x 2 GEMMs per block x 2 FLOPs per multiply-add, g = 3/2 for a gated
    (SwiGLU) FFN and 1 otherwise, k = top_k routed experts, the MoE share = MoE blocks / layers (model.moe's
    dense_layers keep the dense FFN) and V the vocabulary as given (the publisher's padded vocabulary, when the
    corpus row carries it). No recomputation is counted (model FLOPs).

    causal=False gives `megatron_2024`: the function as it stood from 2024-04-04 (Megatron-LM 38fa8bca48,
    "fix_memory_and_flops": the gated 3/2 and the head_dim ratio added) to 2025-03-05 (8873b55's parent): the
    scores counted over the full s x s square, s/h where the 2025 form has s/(2h), and top_k experts (plus shared
    ones) on every layer (no dense_layers split). NeMo's nemo/utils/flops_formulas.py (llama2, llama3, ...) had
    the same value until 2025-08-09 (6251117f4c, "Discount FLOPs in dot-product att"), and NeMo's 24.07 table
    agrees with it (Llama 2 7B at seq 4096: 780 TFLOP/s over 16934 tokens/s = 46.06 GFLOP per token, this
    form 46.08; the causal one would print 726)."""
    from hpctrain.config.moe import expert_width, shared_width
    from hpctrain.plan.model_stats import head_dim, moe_layer_count

    layers, hidden, seq, vocab = int(model.layers), int(model.hidden), int(model.seq_len), int(model.vocab)
    heads, kv_heads = int(model.heads), int(model.kv_heads or model.heads)
    gated = 1.5 if model.activation == "swiglu" else 1.0
    moe = getattr(model, "moe", None)
    n_moe = moe_layer_count(model) if causal else (layers if moe is not None else 0)
    ffn = float(model.ffn_hidden) * gated * (layers - n_moe) / layers
    if moe is not None:
        ffn += (expert_width(moe, int(model.ffn_hidden)) * int(moe.top_k) * 1.5
                + shared_width(moe, int(model.ffn_hidden)) * 1.5) * n_moe / layers
    query_ratio = heads * head_dim(model) / hidden
    scores = seq / hidden / 2 if causal else seq / hidden
    attention = 12.0 * layers * hidden**2 * (1 + kv_heads / heads + scores) * query_ratio
    return 12.0 * layers * hidden * ffn + attention + 6.0 * hidden * vocab


def to_unit(run: dict[str, Any], model: Any, hw: Any, tokens_per_s_per_gpu: float) -> float:
    """Tokens/s per GPU in the publisher's unit."""
    metric = run["metric"]
    if metric["unit"] == "tokens_per_s_per_gpu":
        return tokens_per_s_per_gpu
    if metric["unit"] == "step_time_s":  # one iteration of the global batch
        return run["global_batch"] * model.seq_len / (tokens_per_s_per_gpu * run["hardware"]["gpus"])
    flops = publisher_flops_per_token(model, metric["flops"]) * tokens_per_s_per_gpu
    if metric["unit"] == "tflops_per_gpu":
        return flops / 1e12
    if metric["unit"] == "mfu":
        return flops / hw.gpu.peak_flops_per_s("bf16")
    raise SystemExit(f"run {run['name']!r}: unknown unit {metric['unit']!r}")


def family_rank(layouts: list[Any], family: tuple[int, int]) -> Optional[int]:
    """1-based rank of a (tp, pp) family, families ordered by their best layout."""
    seen: list[tuple[int, int]] = []
    for lay in layouts:
        key = (lay.tp, lay.pp)
        if key not in seen:
            seen.append(key)
            if key == family:
                return len(seen)
    return None


def _dispatcher(run: dict[str, Any]) -> str:
    """The publisher's expert dispatcher (corpus field `dispatcher`, default alltoall; cost_setup.CostSetup.dispatcher)."""
    from hpctrain.plan.comm import DEDUP_DISPATCHERS

    known = ("alltoall", *DEDUP_DISPATCHERS)
    dispatcher = run.get("dispatcher", "alltoall")
    if dispatcher not in known:
        raise SystemExit(f"run {run['name']!r}: dispatcher must be one of {', '.join(known)} (got {dispatcher!r})")
    return str(dispatcher)


CUDA_GRAPHS = ("none", "layers", "full_iteration")


def _cuda_graph(run: dict[str, Any]) -> str:
    """The publisher's CUDA graphs (corpus field `cuda_graph`, CUDA_GRAPHS): none (the default), layers (Transformer
    Engine's per-layer graphs of a block's dense parts: cost_setup.CostSetup.layer_graphs) or full_iteration."""
    graph = run.get("cuda_graph", "none")
    if graph not in CUDA_GRAPHS:
        raise SystemExit(f"run {run['name']!r}: cuda_graph must be one of {', '.join(CUDA_GRAPHS)} (got {graph!r})")
    return str(graph)


def _moe_sync(run: dict[str, Any]) -> str:
    """When the publisher's MoE blocks wait for their routing sizes on the host (moe_cost.MOE_SYNCS): never with token
    dropping padded to capacity (`token_drop`) or under a full-iteration CUDA graph (`cuda_graph`, whose MoE is
    sync-free); always with Megatron-Core's dropless MoE (the tokens per expert); else as hpctrain's runtime (ep > 1)."""
    graph = _cuda_graph(run)
    if run.get("token_drop") or graph == "full_iteration":
        return "none"
    return "always" if _stack(run) == "megatron-te" else "ep"


CP_ROTATIONS = ("allgather", "ring")


def _stage_split(run: dict[str, Any]) -> str:
    from hpctrain.plan.stages import STAGE_SPLITS

    split = run.get("stage_split", "balanced")
    if split not in STAGE_SPLITS:
        raise SystemExit(f"run {run['name']!r}: stage_split must be one of {', '.join(STAGE_SPLITS)} (got {split!r})")
    return str(split)


def _cp_rotate(run: dict[str, Any]) -> str:
    """The publisher's context-parallel exchange (corpus field `cp_rotate`, default allgather; parallel.cp_rotate):
    ring for Megatron-Core's point-to-point CP (Transformer Engine attention, K/V chunks around the cp ring)."""
    rotate = run.get("cp_rotate", "allgather")
    if rotate not in CP_ROTATIONS:
        raise SystemExit(f"run {run['name']!r}: cp_rotate must be one of {', '.join(CP_ROTATIONS)} (got {rotate!r})")
    return str(rotate)


def _attention(run: dict[str, Any]) -> str:
    """The publisher's attention kernel (corpus field `attention`, default flash; cost.py)."""
    from hpctrain.plan.cost import ATTENTION_KERNELS

    kernel = run.get("attention", "flash")
    if kernel not in ATTENTION_KERNELS:
        raise SystemExit(f"run {run['name']!r}: attention must be one of {', '.join(ATTENTION_KERNELS)} (got {kernel!r})")
    return kernel


def predict(run: dict[str, Any], gemm_efficiency: Optional[dict[tuple[str, str], float]] = None
            ) -> tuple[Any, Any, bool]:
    """(hardware, layout, fits): the planner's best layout within the published one, searched
    with the GPU's memory as the search itself would. Only when nothing fits is it searched again
    without a memory limit, so that a layout the memory model rejects is still costed (a search
    without a limit cannot be used first: the search drops full recomputation wherever selective
    "fits", and without a limit selective always does)."""
    job = _job(run, fixed=True)
    hw = _hardware(job, gemm_efficiency, run)
    layouts, _ = _search(job, hw, run=run)
    if layouts:
        return hw, layouts[0], True
    layouts, _ = _search(job, hw, budget_bytes=float("inf"), run=run)
    if not layouts:
        raise SystemExit(f"run {run['name']!r}: the published layout is not a valid candidate (check tp/pp/dp/batch)")
    return hw, layouts[0], False


def evaluate(run: dict[str, Any], gemm_efficiency: Optional[dict[tuple[str, str], float]] = None,
             rank: bool = True) -> Outcome:
    hw, lay, fits = predict(run, gemm_efficiency)
    job = _job(run, fixed=False)
    position, note = None, ""
    if rank:
        layouts, rejected = _search(job, hw, run=run)
        family = (run["layout"].get("tp") or 1, run["layout"].get("pp") or 1)
        position = family_rank(layouts, family)
        if position is None:
            reason = rejected.family_reasons.get(family)
            note = f"infeasible: {reason[1]}" if reason else "infeasible"
        elif layouts:
            note = f"best: {layouts[0].label()}"
    world = run["hardware"]["gpus"]
    predicted = to_unit(run, job.model, hw, lay.cost.tokens_per_s / world)
    return Outcome(name=run["name"], set=run["set"], layout_case=bool(run["layout_case"]), rank=position,
                   rank_note=note, unit=run["metric"]["unit"], published=float(run["metric"]["value"]),
                   predicted=predicted, layout=lay.label(), fits=fits, memory_gib=lay.memory.total / GIB,
                   published_memory_gib=run.get("memory_gib"))


def failed(run: dict[str, Any], why: str) -> Outcome:
    """A corpus run the planner cannot cost (an unknown name, an impossible layout): a miss."""
    metric = run.get("metric", {})
    return Outcome(name=run.get("name", "?"), set=run.get("set", "validation"), layout_case=bool(run.get("layout_case")),
                   rank=None, rank_note="", unit=metric.get("unit", "?"), published=float(metric.get("value", 0) or 0),
                   predicted=float("nan"), layout="", fits=False, memory_gib=float("nan"),
                   published_memory_gib=None, failure=why.strip().splitlines()[0] if why.strip() else "error")


def evaluate_or_fail(run: dict[str, Any], gemm_efficiency: Optional[dict[tuple[str, str], float]] = None) -> Outcome:
    from hpctrain.errors import ConfigError

    try:
        return evaluate(run, gemm_efficiency)
    except (ValueError, KeyError, TypeError, SystemExit, ConfigError) as exc:
        return failed(run, f"{type(exc).__name__}: {exc}" if not isinstance(exc, SystemExit) else str(exc))


def summary(outcomes: list[Outcome], which: str) -> dict[str, Any]:
    """The figures of one set: top-5 share of layout cases, +-15 % share and median |error|."""
    chosen = [o for o in outcomes if o.set == which]
    layout_cases = [o for o in chosen if o.layout_case]
    top = sum(1 for o in layout_cases if o.rank is not None and o.rank <= TOP)
    within = sum(1 for o in chosen if abs(o.error) <= TOLERANCE)
    errors = [abs(o.error) for o in chosen]
    return {"set": which, "layout_cases": len(layout_cases), "top5": top,
            "top5_share": top / len(layout_cases) if layout_cases else float("nan"),
            "throughput_cases": len(chosen), "within": within,
            "within_share": within / len(chosen) if chosen else float("nan"),
            "median_abs_error": statistics.median(errors) if errors else float("nan"),
            "not_costed": sum(1 for o in chosen if o.failure)}


CATEGORIES = ("dense", "MoE", "CP", "FP8")


def categories(run: dict[str, Any]) -> list[str]:
    """The categories a corpus run counts in (a CP run in FP8 counts in both; dense: none of the others)."""
    out = []
    if run["model"].get("moe") is not None:
        out.append("MoE")
    if (run["layout"].get("cp") or 1) > 1:
        out.append("CP")
    if run.get("precision") == "fp8":
        out.append("FP8")
    return out or ["dense"]


def category_line(outcomes: list[Outcome], runs: list[dict[str, Any]], which: str, category: str) -> str:
    chosen = [o for o, r in zip(outcomes, runs) if o.set == which and category in categories(r)]
    if not chosen:
        return f"  {which} {category}: no runs"
    within = sum(1 for o in chosen if abs(o.error) <= TOLERANCE)
    errors = sorted(abs(o.error) for o in chosen)
    return (f"  {which} {category}: throughput within +-{TOLERANCE:.0%}: {within}/{len(chosen)} "
            f"({within / len(chosen):.0%}); median |error| {statistics.median(errors):.1%}")


def kendall_tau(published: list[float], predicted: list[float]) -> float:
    """Kendall's tau-a between two orderings of the same rows (ties count as neither)."""
    n, score = len(published), 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = published[i] - published[j], predicted[i] - predicted[j]
            score += (a * b > 0) - (a * b < 0)
    return score / (n * (n - 1) / 2) if n > 1 else float("nan")


def table_lines(outcomes: list[Outcome], runs: list[dict[str, Any]]) -> list[str]:
    """Per corpus table with >= 3 layouts of one model on one cluster: Kendall's tau between the published and
    the predicted throughputs, and whether the published best is in the planner's top 3 of the table."""
    tables: dict[str, list[Outcome]] = {}
    for o, r in zip(outcomes, runs):
        if r.get("table") and not o.failure:
            tables.setdefault(r["table"], []).append(o)
    lines = []
    for name, rows in sorted(tables.items()):
        if len(rows) < 3:
            continue
        published = [o.published if o.unit not in TIME_UNITS else -o.published for o in rows]
        predicted = [o.predicted if o.unit not in TIME_UNITS else -o.predicted for o in rows]
        best = max(range(len(rows)), key=lambda i: published[i])
        top3 = sorted(range(len(rows)), key=lambda i: -predicted[i])[:3]
        lines.append(f"  table {name} ({rows[0].set}, {len(rows)} layouts): Kendall tau "
                     f"{kendall_tau(published, predicted):+.2f}; published best {rows[best].name} "
                     f"{'in' if best in top3 else 'NOT in'} the planner's top 3")
    return lines


def summary_line(s: dict[str, Any]) -> str:
    if not s["throughput_cases"]:
        return f"{s['set']}: no runs selected"
    return (f"{s['set']}: published (tp,pp) in top {TOP}: {s['top5']}/{s['layout_cases']} ({s['top5_share']:.0%}); "
            f"throughput within +-{TOLERANCE:.0%}: {s['within']}/{s['throughput_cases']} ({s['within_share']:.0%}); "
            f"median |error| {s['median_abs_error']:.1%}"
            + (f"; {s['not_costed']} not costed, counted as misses" if s.get("not_costed") else ""))


def _format(value: float, unit: str) -> str:
    if unit in TIME_UNITS:
        return f"{value:.2f} s"
    return f"{value:.1%}" if unit == "mfu" else (f"{value:,.0f}" if unit == "tokens_per_s_per_gpu" else f"{value:.0f}")


def row(o: Outcome) -> str:
    if o.failure:
        return f"{o.name:<27} {o.set[:3]} NOT COSTED (counted as a miss): {o.failure}"
    rank = "-" if o.rank is None else str(o.rank)
    case = "" if o.layout_case else "*"
    memory = f"{o.memory_gib:.0f} GiB" + ("" if o.fits else " over") + (
        f" (published {o.published_memory_gib:.0f})" if o.published_memory_gib is not None else "")
    return (f"{o.name:<27} {o.set[:3]} rank {rank:>2}{case:1} {o.unit:<20} published {_format(o.published, o.unit):>8} "
            f"predicted {_format(o.predicted, o.unit):>8} ({o.error:+.0%})  {memory:<24} [{o.layout}] {o.rank_note}")


GEMM_GRID = [round(0.50 + 0.01 * i, 2) for i in range(46)]  # 0.50 .. 0.95


def fit_gemm_efficiency(runs: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Per (GPU model, software stack), the GEMM efficiency that minimises the median |log(predicted / published)|
    over the CALIBRATION runs on that GPU with that stack (validation runs are never looked at)."""
    import math

    from hpctrain.plan.hardware import FP8_GEMM_MEASURED_TFLOPS, GPUS
    from hpctrain.plan.kernels import FP8_GEMM_EFFICIENCY_RATIO

    calibration = [r for r in runs if r["set"] == "calibration"]
    fitted: dict[tuple[str, str], float] = {}
    for key in sorted({(r["hardware"]["gpu"], _stack(r)) for r in calibration}):
        mine = [r for r in calibration if (r["hardware"]["gpu"], _stack(r)) == key]
        grid = GEMM_GRID
        measured = FP8_GEMM_MEASURED_TFLOPS.get(key[0])
        if measured and all(r.get("precision") == "fp8" for r in mine):  # no faster than cuBLASLt alone (hardware.py)
            ceiling = measured * 1e12 / (GPUS[key[0]].fp8_rate_flops_per_s * FP8_GEMM_EFFICIENCY_RATIO)
            grid = [g for g in GEMM_GRID if g <= ceiling]

        def loss(value: float) -> float:
            errs = [abs(math.log(evaluate(r, {key: value}, rank=False).predicted / r["metric"]["value"]))
                    for r in mine]
            return statistics.median(errs)

        fitted[key] = min(grid, key=loss)
    return fitted


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--only", nargs="*", help="run names to evaluate (default: all)")
    parser.add_argument("--fit", action="store_true", help="fit GEMM efficiency per GPU on the calibration set")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    runs = load_corpus(args.corpus)
    if args.only:
        unknown = sorted(set(args.only) - {r["name"] for r in runs})
        if unknown:
            raise SystemExit(f"--only: unknown run name(s) {', '.join(unknown)}; known: {', '.join(r['name'] for r in runs)}")
        runs = [r for r in runs if r["name"] in set(args.only)]
    fitted: Optional[dict[tuple[str, str], float]] = None
    if args.fit:
        fitted = fit_gemm_efficiency(runs)
        print("fitted on calibration: " + ", ".join(f"{gpu} ({stack}) gemm_efficiency={v:.2f}"
                                                    for (gpu, stack), v in fitted.items()))
    outcomes = [evaluate_or_fail(r, fitted) for r in runs]
    print("rank: of the published (tp,pp) family in the full search (* = not a layout case); "
          "predicted: the best layout within the published one")
    for o in outcomes:
        print(row(o))
    for which in ("calibration", "validation"):
        print(summary_line(summary(outcomes, which)))
        for category in CATEGORIES:
            print(category_line(outcomes, runs, which, category))
    for line in table_lines(outcomes, runs):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
