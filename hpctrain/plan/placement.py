"""Rank placement: which process slot runs which global rank, and the sbatch --switches request.

Slots are Slurm's task ids: slot = node_index * gpus_per_node + local GPU index (SLURM_PROCID,
with SLURM_LOCALID the GPU). Global ranks are the runtime's grid `arange(world).view(pp, dp, tp)`
(runtime/parallel/dims.py); with context parallelism `view(pp, dp, cp, tp)`, which the planner passes as
dp x cp in the dp place (plan/planner.py), cp inside dp. The placement walks slots in the order TP innermost (inside one NVLink
island), then PP, then DP outermost, so tensor-parallel peers share NVLink, a pipeline stays on
as few nodes as possible, and only data-parallel traffic (overlapped with backward) crosses
leaf switches first (Narayanan et al. 2021, section 3.3, on placing TP inside a server). With expert
parallelism the walk is TP, then DP (x CP), then PP outermost (plan/comm.py pipeline_outermost): an ep group
is ep consecutive ranks of a stage's (dp, cp, tp) grid (runtime/parallel/expert.py), so ep consecutive slots,
and the experts' all-to-alls stay inside a node before the pipeline's sends do.

`rank_order[slot]` is the global rank the process on that slot takes; None means the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hpctrain.plan.topology import GpuTopology, SwitchTree


def local_gpu_order(gpus_per_node: int, topology: Optional[GpuTopology] = None) -> list[int]:
    """Local GPU indices grouped island by island (identity without a topology file)."""
    if topology is None or len(topology.gpus) != gpus_per_node:
        return list(range(gpus_per_node))
    return [gpu for island in topology.islands for gpu in island]


def rank_order(tp: int, pp: int, dp: int, gpus_per_node: int, local_order: Optional[list[int]] = None,
               pipeline_outermost: bool = False) -> Optional[list[int]]:
    """rank_order[slot] = global rank (see the module docstring); None when it is the identity.
    `pipeline_outermost` (layouts with expert parallelism, plan/comm.py pipeline_outermost): TP innermost,
    then DP, then PP, so that an ep group's consecutive ranks share a node."""
    world = tp * pp * dp
    local = local_order if local_order is not None else list(range(gpus_per_node))
    order = [0] * world
    for position in range(world):
        if pipeline_outermost:
            p, rest = divmod(position, dp * tp)
            d, t = divmod(rest, tp)
        else:
            d, rest = divmod(position, pp * tp)
            p, t = divmod(rest, tp)
        node, index = divmod(position, gpus_per_node)
        slot = node * gpus_per_node + local[index]
        order[slot] = (p * dp + d) * tp + t
    return None if order == list(range(world)) else order


def switches_request(nodes: int, tree: Optional[SwitchTree]) -> Optional[int]:
    """sbatch --switches=1 when the whole job fits under one leaf switch, else no request."""
    if tree is None or nodes > tree.max_leaf_nodes:
        return None
    return 1


@dataclass(frozen=True)
class PlacementPlan:
    """The resolved job's `placement` section."""

    stage_layers: list[list[int]]
    rank_order: Optional[list[int]]
    switches: Optional[int]

    def to_dict(self) -> dict[str, Any]:
        return {"stage_layers": self.stage_layers, "rank_order": self.rank_order, "switches": self.switches}
