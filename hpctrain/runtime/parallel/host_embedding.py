"""The token embedding in host memory (`train.embedding_on_cpu`).

The table, its gradient and its optimizer state live on the CPU; the lookup runs there and only its
output [batch, seq, hidden] moves to the device (and its gradient back, through autograd's copy). A
vocabulary of 128k x 4096 in fp32 is 2 GiB of weights, 2 GiB of gradient and 4 GiB of AdamW moments
that leave the device; the price is two [tokens, hidden] copies over the host link per micro-batch
(plan/cost.py `embedding_transfer_s`) and the lookup's gather on the CPU.

How it composes:
- FSDP2: the table is no FSDP unit and is left out of the root's (`fully_shard(ignored_params=...)`),
  so every dp rank holds it whole; after backward its gradient is averaged over dp by one all-reduce
  (`average_over_dp`), on a gloo group when the process group is NCCL (the gradient is on the host).
- Precision: the output is cast to the compute dtype on the host before it travels, which is what the
  device's lookup of 16-bit weights gives (a gather commutes with rounding) and halves the copy.
- TP and tied embeddings are refused by validate (config/job.py): the vocabulary-parallel lookup
  reduces over the tp group, and a tied head would need the table on the device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HOST = torch.device("cpu")


class HostEmbedding(nn.Embedding):
    """nn.Embedding whose table stays on the host; set up by `keep_on_host`."""

    output_device: torch.device
    output_dtype: torch.dtype | None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids.to(self.weight.device), self.weight)
        if self.output_dtype is not None:
            out = out.to(self.output_dtype)
        return out.to(self.output_device, non_blocking=True)


def keep_on_host(embedding: nn.Embedding, device: torch.device, output_dtype: torch.dtype | None) -> None:
    """Mark `embedding` (still on meta) to live on the host and send its output to `device`."""
    embedding.__class__ = HostEmbedding
    assert isinstance(embedding, HostEmbedding)
    embedding.output_device = device
    embedding.output_dtype = output_dtype


def host_group(mesh: Any) -> Any:
    """A process group over this rank's dp ranks that can reduce host tensors: the mesh's dp group on gloo,
    else a gloo group over the same ranks. Every rank calls it (new_group is collective): each creates the
    gloo group of every (pp, tp) slot and keeps its own."""
    dp_group = mesh["dp"].get_group()
    if dist.get_backend(dp_group) == "gloo":
        return dp_group
    grid, rank, mine = mesh.mesh, dist.get_rank(), None
    for p in range(grid.shape[0]):
        for t in range(grid.shape[2]):
            ranks = [int(r) for r in grid[p, :, t]]
            group = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                mine = group
    return mine


def average_over_dp(embedding: nn.Embedding, group: Any, dp: int) -> None:
    """The table's gradient, summed over this rank's micro-batches, becomes the dp mean (FSDP's reduction
    of every other gradient divides by dp as well)."""
    grad = embedding.weight.grad
    if grad is None or dp <= 1:
        return
    dist.all_reduce(grad, group=group)
    grad.div_(dp)
