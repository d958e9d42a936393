"""Expert parallelism (`parallel.ep`): the routed experts split over ep of a stage's data-, context- and
tensor-parallel ranks.

The mesh (torchtitan's `ParallelDims` with expert tensor parallelism 1 does the same,
torchtitan/distributed/parallel_dims.py): the dense part of the model sees ("pp", "dp", ["cp",] "tp"); the
routed experts see the same ranks with (dp, [cp,] tp) flattened (tp innermost) and unflattened again into
("efsdp", "ep"), ep innermost, so one ep group is ep consecutive ranks of a stage, whole tp groups side by side:

    (dp, cp, tp) index (d * cp + c) * tp + t = efsdp index * ep + ep index
    dp4 ep2 (tp1): ep groups {0, 1}, {2, 3}; efsdp {0, 2}, {1, 3}
    dp2 tp2 ep2:   ep groups = the tp groups {0, 1}, {2, 3}; efsdp {0, 2}, {1, 3}
    dp2 tp2 ep4:   one ep group {0, 1, 2, 3}; efsdp of one rank each
    cp2 ep2:       the ep group is the cp group {0, 1}
    dp2 cp2 ep2:   ep groups = the cp groups {0, 1}, {2, 3}; efsdp {0, 2}, {1, 3}
    cp2 tp2 ep2:   ep groups = the tp groups {0, 1}, {2, 3} (each cp rank's); efsdp = across cp {0, 2}, {1, 3}

Context parallelism folds into the experts' grouping (Megatron-Core's "MoE parallel folding",
megatron/core/transformer/moe/README.md; its expert rank grid, megatron/core/parallel_state.py, spans the dense
grid's tp-cp-dp ranks with cp=1, ep next to the expert tensor parallelism): routing is per token, and each cp
rank holds other tokens of the same sequences, so a cp rank is one more source of tokens like a dp or tp rank.
The rule: ep divides dp x cp x tp (and is a multiple of tp, below); efsdp = dp x cp x tp / ep.

With tp > 1 ep must be a multiple of tp and sequence parallelism is on (config/job.py and dims.py refuse
otherwise): each tp rank holds a different slice of the sequence at the MoE input and routes its own tokens,
which the all-to-all below moves like any other rank's; attention and the shared experts stay tensor-parallel
and the router is replicated over tp, its gradient summed over the sequence shards (tensor.py
`_moe_over_tp`); the balancing loss and the capacity see the whole micro-batch's counts (moe.py, through
sequence.py's `SequenceShards`, over the tp ranks, or the cp x tp ranks with context parallelism: context.py
`route_over_sequence_shards`), so every layout computes what one process does.

Parameters: ep rank r holds experts [r*E/ep, (r+1)*E/ep) of `experts.w1/w2/w3` as DTensors Shard(0) over
the "ep" mesh (so the names and global shapes are those of one process: DCP saves global tensors, and
sharded initialisation and Hugging Face reading fill each rank's box of experts). FSDP then shards each
MoE block's experts over "efsdp" as a unit of its own (the rest of the block over "dp" as before). An
expert's gradient sums its tokens from the ep group (the all-to-all's backward brings them); the
reduce-scatter over efsdp sums the rest of the dp x cp x tp ranks (each rank's tokens are its own: dp ranks hold
other sequences, cp and tp ranks other positions of them), and the divide factor dp x cp, FSDP's dense degree
(not efsdp, not dp x cp x tp: the tp ranks of one (dp, cp) rank share one loss, and each cp rank's loss is the
mean of its own tokens, which FSDP averages over dp x cp for the dense part too) makes it the global-batch mean,
the same as one process (torchtitan's moe_sharding: `set_gradient_divide_factor`). The gradient norm counts each
expert element once: the experts are sharded over efsdp x ep = dp x cp x tp ranks, all of a stage's (grad_norm.py).

Dispatch, per MoE layer and micro-batch (after routing, capacity and the sort by expert, moe.py):
  1. the per-expert counts [E] go to their owners (all_to_all_single of counts: ep x E/ep each way),
  2. the sorted token rows go to the ranks that own their experts (all_to_all_single, autograd: its
     backward is the reverse all-to-all), arriving ordered by source rank then local expert,
  3. they are regrouped by local expert (a stable sort) for the grouped GEMM over the local experts,
  4. put back in arrival order and returned by the reverse all-to-all, in the order they were sent;
the weighted scatter-add and the shared experts run as without ep. The counts cross to the host once (the
splits of the all-to-all), as in torchtitan's token dispatcher (torchtitan/overrides/moe_token_dispatcher.py).
The exchanges are torch's functional collectives (`all_to_all_single`; for the rows inside `_AllToAll`, whose
backward is the reverse all-to-all, as torch's `all_to_all_single_autograd`): selective activation
checkpointing saves their outputs (activation_checkpoint.py) instead of communicating again, and ranks never
recompute a different routing. Every exchange waits through `wait_all_to_all`, which the communication timer
times as all-to-all (runtime/observe/comm_timing.py: `time_all_to_all_s` in metrics.jsonl).
The experts themselves are never tensor-parallel (expert tensor parallelism, Megatron-Core's ETP > 1, is not
built).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.moe import GroupedExperts, MoE

EXPERT_WEIGHTS = ("w1", "w2", "w3")


@dataclass
class ExpertGroup:
    """The ep process group of this rank and its share of the experts."""

    group: Any  # ProcessGroup
    size: int
    rank: int
    local_experts: int

    def run(self, moe: MoE, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """MoE.forward's call (moe.py imports nothing from here): `run_experts`."""
        return run_experts(moe, x, counts)


def sparse_mesh(mesh: Any, ep: int) -> Any:
    """The experts' mesh ("efsdp", "ep") of this rank's pipeline stage: its (dp, [cp,] tp) ranks flattened (tp
    innermost) and unflattened again, ep innermost (module docstring); the same root mesh as the dense
    ("pp", "dp", ["cp",] "tp"), which FSDP needs to shard the ep-sharded experts over efsdp."""
    from torch.distributed.fsdp import FSDPModule

    missing = [name for owner, name in ((mesh, "_unflatten"), (mesh, "_flatten"),
                                        (FSDPModule, "set_force_sum_reduction_for_comms"))
               if not hasattr(owner, name)]
    if missing:  # torch's own versions of both: expert parallelism is built and tested on torch 2.13
        raise ConfigError(f"parallel.ep: got {ep}; this torch ({torch.__version__}) lacks {', '.join(missing)}, "
                          "which expert parallelism needs; set parallel.ep: 1, or use torch 2.13")
    dims = ("dp", "cp", "tp") if "cp" in (mesh.mesh_dim_names or ()) else ("dp", "tp")
    region = mesh[dims]._flatten("_".join(dims))  # rank index (dp * cp + cp) * tp + tp: whole tp groups side by side
    return region._unflatten(0, (region.size() // ep, ep), ("efsdp", "ep"))


def apply_ep(modules: Iterable[nn.Module], ep_mesh: Any) -> None:
    """Make each MoE layer's routed experts DTensors Shard(0) over `ep_mesh` (on meta, before FSDP and
    materialisation) and give the layer its ep group."""
    from torch.distributed.tensor import DTensor, Shard

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in modules:
        for moe in (m for m in module.modules() if isinstance(m, MoE)):
            experts: GroupedExperts = moe.experts
            total = moe.args.experts
            if total % size:
                raise ValueError(f"model.moe.experts={total} does not split over parallel.ep={size}")
            local = total // size
            for name in EXPERT_WEIGHTS:
                full = getattr(experts, name)
                piece = full.detach()[rank * local:(rank + 1) * local]
                sharded = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False,
                                             shape=full.shape, stride=full.stride())
                setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
            moe.ep = ExpertGroup(ep_mesh.get_group(), size, rank, local)


def shard_experts(block: nn.Module, efsdp_mesh: Any, dp: int, **fsdp_kwargs: Any) -> None:
    """FSDP-shard a block's routed experts over efsdp as their own unit, gradients divided by dp (module
    docstring); the caller then shards the block over dp, which leaves these parameters to this unit."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for moe in (m for m in block.modules() if isinstance(m, MoE) and m.ep is not None):
        assert moe.ep is not None
        local, shards = moe.ep.local_experts, efsdp_mesh.size()
        # Experts per rank that do not split evenly over efsdp: shard the rows instead (torchtitan does too).
        dim = 0 if local % shards == 0 else 1
        placement = Shard(dim)
        fully_shard(moe.experts, mesh=efsdp_mesh, shard_placement_fn=lambda _p: placement, **fsdp_kwargs)
        state: Any = moe.experts
        state.set_gradient_divide_factor(float(dp))
        if shards > 1:
            # SUM and a division after it: gloo has no PREMUL_SUM. Not on one rank: there torch 2.13's
            # foreach_reduce divides by the factor when it copies, and then again after (divided twice).
            state.set_force_sum_reduction_for_comms(True)


def wait_all_to_all(tensor: torch.Tensor) -> torch.Tensor:
    """Wait for an expert-parallel all-to-all (the communication timer wraps this function by name)."""
    return funcol.wait_tensor(tensor)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    return wait_all_to_all(funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group=group))


class _AllToAll(torch.autograd.Function):
    """The rows to their owners; backward: their gradients back by the reverse all-to-all (torch's
    `all_to_all_single_autograd`, torch/distributed/_functional_collectives.py, with a timed wait)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def run_experts(moe: MoE, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [R, h] sorted by global expert, counts [E] -> the experts' outputs for those rows, in that order,
    the experts running on the ranks that own them (module docstring, steps 1-4)."""
    ep = moe.ep
    assert ep is not None
    send = counts.to(torch.int64).reshape(ep.size, ep.local_experts)  # [owner rank, its local expert]
    even = [ep.local_experts] * ep.size
    recv = _exchange(send.reshape(-1), even, even, ep.group).reshape(ep.size, ep.local_experts)  # [source, mine]
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    arrived: torch.Tensor = _AllToAll.apply(x, out_splits, in_splits, ep.group)
    local_ids = torch.arange(ep.local_experts, device=x.device).repeat(ep.size)
    expert_of_row = torch.repeat_interleave(local_ids, recv.reshape(-1).to(x.device))
    perm = torch.argsort(expert_of_row, stable=True)
    out = moe.experts(arrived[perm], recv.sum(0).to(x.device))
    back = out[torch.argsort(perm)]
    returned: torch.Tensor = _AllToAll.apply(back, in_splits, out_splits, ep.group)
    return returned
