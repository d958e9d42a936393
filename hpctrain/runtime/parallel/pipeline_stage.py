"""The pipeline stage and schedules over `torch.distributed.pipelining` (parallel/pipeline.py builds them).

A module of its own so that a run without pipelining never imports torch.distributed.pipelining, which imports
torch._dynamo and inductor's configuration (~0.6 s of each rank's start on a 2-core machine).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from hpctrain.runtime.model.moe import paused_moe_stats

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
}


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
