"""LoRA in the planner (issue 15 item 4): which parameters train, and what the adapters change in
activation memory. Pure Python, the runtime's layout (hpctrain/runtime/model/lora.py):

- Parameters: the frozen base keeps its fp32 copy (the runtime stores every parameter in fp32, frozen
  or not) and FSDP still shards and gathers it; gradients, optimizer states, FSDP's gradient
  accumulation and reduce-scatter buffers exist for the adapters only.
- Adapters per projection of shape in -> out: A [rank, in], B [out, rank]; under TP a column-parallel
  projection has A replicated and B split over out, a row-parallel one A split over in and B replicated.
- Activations (no checkpointing): a frozen projection no longer saves its input for a weight gradient.
  An input is still saved when an adapter without dropout reads it (the same tensor); with dropout
  each adapter saves its own dropped-out copy and the 1-byte mask. Each adapter also saves its
  [tokens, rank] intermediate. The frozen head saves no input; the frozen embedding no token ids.

Checked against MemTracker (tests/plan/test_lora_memory.py; bench/memory_accuracy.py's machinery):
every category within tolerance at ac none, 1 GPU / tp2 / tp2 x dp2, all or two targets; on the 1.1B
shape (fake tensors, too slow for a test) 1 GPU bf16, dp8 zero3 and dp8 zero1 with 2 micro-batches
agree within 0.3 % in total; full checkpointing (small shape, 1 GPU bf16) within 2.5 % in total (ACT
+0.8 MiB). Known gaps: selective checkpointing under LoRA (the policy keeps the
adapters' full-size B outputs, and the peak moves: planner -16 % of ACT on the 1.1B shape; not modelled),
and dropout measured on the CPU (CPU dropout keeps a full-precision noise tensor, where the GPU's fused
kernel keeps the 1-byte mask modelled here: -4 % of the total on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hpctrain.plan.activations import HeadActivations, LayerActivations, dtypes

if TYPE_CHECKING:
    from hpctrain.config import Job

MASK_BYTES = 1  # torch's dropout keeps a bool mask for backward
COLWISE = ("wq", "wk", "wv", "w1", "w3")
# Projections that read one shared input tensor: the attention input (after its norm), wo's input
# (the attention output, which SDPA saves anyway), the FFN input, w2's input (the product/activation).
INPUT_GROUPS = {"attention input": ("wq", "wk", "wv"), "ffn input": ("w1", "w3"), "w2 input": ("w2",)}


@dataclass(frozen=True)
class LoraShape:
    """The planner's view of `train.lora`."""

    rank: int
    targets: tuple[str, ...]
    dropout: float = 0.0


def lora_shape(job: Job) -> LoraShape | None:
    cfg = getattr(job.train, "lora", None)
    if cfg is None:
        return None
    targets = tuple(t for t in cfg.targets if t != "w3" or job.transformer.activation == "swiglu")
    return LoraShape(rank=int(cfg.rank), targets=targets, dropout=float(cfg.dropout))


def projection_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of runtime/model/transformer.py."""
    h, d = int(model.hidden), int(model.hidden) // int(model.heads)
    q, kv, f = int(model.heads) * d, int(model.kv_heads) * d, int(model.ffn_hidden)
    shapes = {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h), "w1": (h, f), "w2": (f, h)}
    if model.activation == "swiglu":
        shapes["w3"] = (h, f)
    return shapes


def adapter_params(model: Any, lora: LoraShape, target: str, tp: int = 1) -> float:
    """Adapter elements of one projection held by one TP rank."""
    fan_in, fan_out = projection_shapes(model)[target]
    if tp == 1:
        return lora.rank * (fan_in + fan_out)
    if target in COLWISE:
        return lora.rank * (fan_in + fan_out / tp)  # A replicated, B split over out
    return lora.rank * (fan_in / tp + fan_out)  # A split over in, B replicated


def adapter_params_per_layer(model: Any, lora: LoraShape, tp: int = 1) -> float:
    return sum(adapter_params(model, lora, t, tp) for t in lora.targets)


def adapter_param_count(model: Any, lora: LoraShape) -> int:
    """Trainable parameters of the whole model: layers x sum over targets of rank x (in + out)."""
    return int(model.layers) * int(adapter_params_per_layer(model, lora))


def layer_activation_delta_per_token(model: Any, lora: LoraShape, tp: int, sp: bool, mode: str) -> float:
    """Saved bytes per token a LoRA layer keeps beyond (negative: below) a fully trained one,
    without activation checkpointing (module docstring)."""
    d = dtypes(mode)
    shapes = projection_shapes(model)
    seq_split = tp if sp else 1
    delta = 0.0
    for group, members in INPUT_GROUPS.items():
        targeted = [t for t in members if t in lora.targets and t in shapes]
        if targeted and not lora.dropout:
            continue  # an adapter saves the same tensor the full model's projections saved
        if group == "w2 input":
            delta -= d.matmul * model.ffn_hidden / tp
        else:
            delta -= d.norm_out * model.hidden / seq_split
    for target in lora.targets:
        delta += d.matmul * lora.rank  # the [tokens, rank] input of B
        if lora.dropout:
            fan_in = shapes[target][0] / (tp if target not in COLWISE else 1)
            delta += (d.matmul + MASK_BYTES) * fan_in
    return delta


def lora_activations(layer: LayerActivations, head: HeadActivations, model: Any, lora: LoraShape, tokens: int,
                     tp: int, sp: bool, ac: str, mode: str) -> tuple[LayerActivations, HeadActivations]:
    """A layer's and the head's activations under LoRA, from the fully trained model's."""
    delta = layer_activation_delta_per_token(model, lora, tp, sp, mode) * tokens
    if ac == "none":
        layer = replace(layer, saved_bytes=max(layer.saved_bytes + delta, 0.0))
    elif ac == "selective":  # the policy keeps matmul outputs: the adapters' rank-sized ones too
        layer = replace(layer, saved_bytes=layer.saved_bytes + dtypes(mode).matmul * lora.rank * tokens
                        * len(lora.targets), recompute_peak_bytes=max(layer.recompute_peak_bytes + delta, 0.0))
    else:  # full: the block input only is kept; the recompute rebuilds the LoRA layer
        layer = replace(layer, recompute_peak_bytes=max(layer.recompute_peak_bytes + delta, 0.0))
    d = dtypes(mode)
    head_input = (d.matmul if d.casts_inputs else d.norm_out) * model.hidden * tokens  # frozen head: not saved
    return layer, replace(head, saved_bytes=max(head.saved_bytes - head_input, 0.0))


def fine_tune_notes(job: Job, measured_load: bool = False) -> list[str]:
    """What the plan assumed about pretrained weights, LoRA and MoE, for the report's notes (`measured_load`: the
    busiest ep rank priced from a run, plan/expert_load.py, whose own note follows)."""
    from hpctrain.plan.model_stats import param_count

    notes = []
    init_from = getattr(job.model, "init_from", None)
    if init_from:
        notes.append(f"weights loaded from {init_from} (model.init_from): the same memory as initialised ones")
    lora = lora_shape(job)
    if lora is not None:
        trained, total = adapter_param_count(job.model, lora), param_count(job.model)
        notes.append(f"LoRA rank {lora.rank} on {' '.join(lora.targets)}: {trained:,} trained parameters "
                     f"({trained / total:.2%} of {total:,}); gradients and optimizer states for the adapters "
                     "only, the frozen base kept in fp32 as the runtime does; step time still counts the "
                     "frozen weights' gradient matmuls (an upper bound)")
        if job.train.activation_checkpointing in ("auto", "selective"):
            notes.append("LoRA with selective activation checkpointing: its activations are an estimate (measured "
                         "up to 16% above the plan on a 1.1B shape); prefer ac none or full for a tight memory budget")
    moe = getattr(job.model, "moe", None)
    if moe is not None:
        ep = job.parallel.ep
        held = ("every rank holds all routed experts of its stages" if ep == 1 else
                "the planner picks ep (parallel.ep: auto)" if not isinstance(ep, int) else
                f"each rank holds {moe.experts // ep} of the {moe.experts} routed experts of its stages (ep={ep})")
        load = ("activations of the busiest ep rank at the run's measured load (below)" if measured_load else
                "activations assume an even load (expert load imbalance 1.0: a rank that receives more "
                "than its share of the dispatched rows holds more; the doctor's router finding reports the "
                "measured load)")
        notes.append(f"model.moe ({moe.experts} experts, top-{moe.top_k}): {held}; FLOPs count the active experts; "
                     f"{load}")
    return notes
