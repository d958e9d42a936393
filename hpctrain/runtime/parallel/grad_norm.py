"""The global gradient norm over a sharded model, and clipping to it.

Each element of the full model's gradient must count once, though a rank holds TP shards, FSDP
shards, replicas over dp and tp, and (tied embeddings under pipelining) two copies of one matrix.
Every parameter gets a weight of 1 / (ranks in its pipeline stage holding the same elements); the
weighted local sums of squares, summed over all ranks, give the squared norm (Megatron-LM's
clip_grad_norm counts the same way, with its duplicate-parameter filter).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hpctrain.runtime.parallel.precision import local_tensor


def is_sharded(placement: Any) -> bool:
    """Shard or FSDP's _StridedShard (whose is_shard() is False): anything but Replicate/Partial."""
    return not (placement.is_replicate() or placement.is_partial())


def norm_weights(model_parts: Iterable[Any], replicas: int,
                 tied_across_stages: bool) -> list[tuple[nn.Parameter, float]]:
    """Per parameter, 1 / (number of ranks in its pp stage holding the same elements): its shard
    count over `replicas` (dp x tp). A tied head's copy on the last stage is left out: the first
    stage counts that matrix."""
    from torch.distributed.tensor import DTensor

    weights = []
    for part in model_parts:
        tied_copy = part.has_tied_copy and tied_across_stages
        for name, p in part.named_parameters():
            if tied_copy and name == "output.weight":
                continue  # counted once, on the first stage
            sharded = 1
            if isinstance(p, DTensor):
                for i, placement in enumerate(p.placements):
                    if is_sharded(placement):
                        sharded *= p.device_mesh.size(i)
            weights.append((p, sharded / replicas))
    return weights


def weighted_grad_sq(weights: list[tuple[nn.Parameter, float]], device: torch.device) -> torch.Tensor:
    """This rank's weighted sum of squared gradient elements (float64, on `device`)."""
    groups: dict[tuple[torch.device, float], list[torch.Tensor]] = {}
    for p, weight in weights:
        if p.grad is not None:
            g = local_tensor(p.grad).detach()
            groups.setdefault((g.device, weight), []).append(g)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for (_, weight), grads in groups.items():
        norms = torch._foreach_norm(grads, 2.0)  # one fused kernel per group, fp32 accumulation
        sq += torch.stack(norms).double().pow(2).sum().to(device) * weight
    return sq


def clip_to(params: Iterable[nn.Parameter], norm: float, max_norm: float | None) -> None:
    """Scale every gradient so that the global norm `norm` becomes at most `max_norm`."""
    if max_norm is not None and math.isfinite(max_norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coef)
