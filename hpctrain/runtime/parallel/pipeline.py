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

import copy
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.moe import paused_moe_stats
from hpctrain.runtime.model.transformer import Transformer, make_stage

if TYPE_CHECKING:
    from hpctrain.config import Job

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
}


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


_SPEC = "_hpctrain_buffer_spec"  # (shape, dtype) of a receive buffer that is not allocated now


class BoundedStage(PipelineStage):
    """A PipelineStage whose receive buffers exist only while their micro-batch is in flight.

    It overrides private hooks of torch.distributed.pipelining (set-up of the receive infos,
    posting of receives, a micro-batch's backward); on a torch whose stage lacks them, the stock
    behaviour (a buffer per micro-batch) remains and only memory differs."""

    # The stage's first forward infers the shapes it sends, on the first micro-batch (or on empty
    # tensors past the first stage): not a training forward, so the MoE layers must not count its tokens.
    # torch 2.13 names it _forward_metadata_inference, earlier ones _shape_inference.
    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with paused_moe_stats():
            return getattr(super(), "_forward_metadata_inference")(*args, **kwargs)

    def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
        with paused_moe_stats():
            return getattr(super(), "_shape_inference")(*args, **kwargs)

    def _setup_forward_recv_info(self, num_microbatches: int, *args: Any, **kwargs: Any) -> None:
        super()._setup_forward_recv_info(1, *args, **kwargs)
        self._replicate_lazily(self.args_recv_info, num_microbatches)

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        super()._setup_backward_recv_info(1)
        self.chunks = num_microbatches
        self._replicate_lazily(self.grad_recv_info, num_microbatches)

    @staticmethod
    def _replicate_lazily(infos: dict[int, Any], num_microbatches: int) -> None:
        template = infos[0]
        for chunk in range(num_microbatches):
            infos[chunk] = tuple(copy.copy(info) for info in template)
            _release(infos[chunk])

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        _allocate(self.args_recv_info.get(fwd_chunk_id, ()), self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        _allocate(self.grad_recv_info.get(bwd_chunk_id, ()), self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        loss = kwargs.get("loss")
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            # The schedule keeps every micro-batch's loss until the step ends; with its graph
            # attached, each one pins its received input (the graph's leaf) for the whole step.
            loss.detach_()
        # The received activation and gradient of this micro-batch are consumed; the input
        # gradient to send back lives on in grads_input (and in the pending send) until sent.
        _release(self.args_recv_info.get(bwd_chunk_id, ()))
        _release(self.grad_recv_info.get(bwd_chunk_id, ()))
        return result


def _release(infos: Any) -> None:
    for info in infos or ():
        buffer = getattr(info, "buffer", None)
        if getattr(info, "is_root_arg", False) or not isinstance(buffer, torch.Tensor):
            continue
        if not hasattr(info, _SPEC) or buffer.numel():
            setattr(info, _SPEC, (tuple(buffer.shape), buffer.dtype))
        info.buffer = torch.empty(0, dtype=buffer.dtype, device=buffer.device)


def _allocate(infos: Any, device: torch.device) -> None:
    for info in infos or ():
        spec = getattr(info, _SPEC, None)
        if spec is not None and isinstance(info.buffer, torch.Tensor) and info.buffer.numel() == 0:
            shape, dtype = spec
            info.buffer = torch.empty(shape, dtype=dtype, device=device)


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
    if schedule not in SCHEDULES:
        raise ConfigError(
            f"parallel.schedule: got {schedule!r}; valid: {', '.join(SCHEDULES)} "
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
