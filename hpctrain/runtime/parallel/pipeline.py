"""Pipeline parallelism with `torch.distributed.pipelining`.

The model is cut into `pp * virtual_stages` stages of consecutive layers; the first stage also
holds the embedding, the last the final norm and head. Stage s runs on pp rank `s % pp` (the
"loop" placement the interleaved schedule expects), so with virtual_stages = v each rank holds v
stages. The layer ranges come from the resolved job (`placement.stage_layers`, the planner's
balanced split that weighs embedding and head) or, without a placement, from the same split
computed here.

Schedules: "gpipe" (all forwards then all backwards), "1f1b" (one forward one backward in steady
state: at most pp micro-batches of activations alive) and "interleaved-1f1b" (v stages per rank:
the bubble shrinks by v at the cost of v times more point-to-point messages).

Memory bounded by the schedule, not the micro-batch count: torch's PipelineStage allocates one
activation receive buffer and one gradient receive buffer per micro-batch when the first step
starts and keeps them for the run, and the last stage keeps every micro-batch's logits to merge
them. `BoundedStage` allocates a receive buffer when its receive is posted and drops it once that
micro-batch's backward has run, and steps run with `return_outputs=False` (the loss is computed
in the last stage, per micro-batch): with 1F1B at most pp - rank micro-batches are alive per rank
whatever the micro-batch count (tests/runtime/test_pipeline_memory.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.transformer import Transformer, make_stage

if TYPE_CHECKING:
    from hpctrain.config import Job

# torch.distributed.pipelining (and the torch._dynamo it imports: ~0.6 s of a rank's start) is imported only
# when a pipeline is built: pipeline_stage.py holds the stage class and the schedules.
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b")


def even_split(layers: int, stages: int) -> list[tuple[int, int]]:
    """Consecutive layer ranges, sizes differing by at most one (earlier stages get fewer, since
    the first stage also holds the embedding and the last one the head)."""
    base, extra = divmod(layers, stages)
    sizes = [base + (1 if i >= stages - extra else 0) for i in range(stages)]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return list(zip(bounds[:-1], bounds[1:]))


def stage_layer_ranges(job: Job, pp: int, virtual_stages: int) -> list[tuple[int, int]]:
    """[first_layer, last_layer_exclusive) per stage, in pipeline order; validated."""
    n_stages = pp * virtual_stages
    layers = job.transformer.layers
    if layers is None:  # validation fills it (from the preset or init_from)
        raise ConfigError("model.layers: unset; the runtime needs a resolved job")
    placement = getattr(job, "placement", None)
    ranges = getattr(placement, "stage_layers", None) if placement is not None else None
    field = "placement.stage_layers"
    if not ranges:
        try:
            from hpctrain.plan.stages import balanced_stage_split
        except ImportError:
            ranges = even_split(layers, n_stages)
        else:
            ranges = balanced_stage_split(job.model, pp, virtual_stages)
        field = "the computed stage split"
    ranges = [(int(a), int(b)) for a, b in ranges]
    expected = 0
    for a, b in ranges:
        if a != expected or b <= a:
            expected = -1
            break
        expected = b
    if len(ranges) != n_stages or expected != layers:
        raise ConfigError(
            f"{field}: got {ranges}; need {n_stages} non-empty consecutive ranges "
            f"(pp={pp} x virtual_stages={virtual_stages}) covering layers 0..{layers} "
            "(re-run `hpctrain plan` to regenerate the placement)"
        )
    return ranges


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Global stage indices held by pp rank `pp_rank` (loop placement)."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


def split_model(
    whole: Transformer, ranges: list[tuple[int, int]], pp_rank: int, pp: int
) -> list[tuple[int, Transformer]]:
    """This rank's (stage index, stage module) pairs, on meta."""
    n_stages = len(ranges)
    parts = []
    for sid in stage_ids(pp_rank, pp, n_stages // pp):
        first, last = ranges[sid]
        parts.append((sid, make_stage(whole, first, last, first=sid == 0, last=sid == n_stages - 1)))
    return parts


def step_kwargs(schedule: Any) -> dict[str, Any]:
    """`return_outputs=False` where the schedule accepts it: no logits kept for a merge."""
    return {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}


def apply_pp(
    parts: list[tuple[int, Transformer]],
    pp_mesh: DeviceMesh,
    device: torch.device,
    *,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """Wrap this rank's (already parallelised, materialised) stage modules and build the schedule.

    `loss_fn` returns the mean loss of one micro-batch; the schedule divides the accumulated
    gradients by `n_microbatches`, so they are the mean over the local batch.
    """
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError(
            f"parallel.schedule: got {schedule!r}; valid: {', '.join(SCHEDULE_NAMES)} "
            "(resolve 'auto' with `hpctrain plan`)"
        )
    pp = pp_mesh.size()
    n_stages = len(parts) * pp
    if schedule != "interleaved-1f1b" and len(parts) != 1:
        raise ConfigError(
            f"parallel.virtual_stages: got {len(parts)}; schedule {schedule!r} runs one stage per rank "
            "(use schedule 'interleaved-1f1b' or virtual_stages=1)"
        )
    if n_microbatches < pp:
        raise ConfigError(
            f"train.micro_batch: gives {n_microbatches} micro-batches per step, fewer than pp={pp}; "
            "the pipeline would idle (lower train.micro_batch or raise train.global_batch)"
        )
    from hpctrain.runtime.parallel.pipeline_stage import SCHEDULES, BoundedStage

    group = pp_mesh.get_group()
    stages = [BoundedStage(module, sid, n_stages, device, group=group) for sid, module in parts]
    cls = SCHEDULES[schedule]
    if schedule == "interleaved-1f1b":
        rounds = max(1, n_microbatches // pp)  # torch's ScheduleInterleaved1F1B requirement
        if n_microbatches % rounds:
            raise ConfigError(
                f"train.micro_batch: gives {n_microbatches} micro-batches; interleaved 1F1B with pp={pp} "
                f"needs a multiple of {rounds} (use a multiple of pp)"
            )
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
