"""The vocab-parallel embedding lookup: each TP rank computes the gradient of its rows only.

`RowwiseParallel` on an `nn.Embedding` shards the weight over the vocabulary (Shard(0)) and DTensor
runs the lookup as a masked partial sum (MaskPartial) — but DTensor has no vocab-sharded strategy
for the backward: `embedding_dense_backward_strategy` (torch/distributed/tensor/_ops/
_embedding_ops.py, torch 2.13) only offers a Shard(1), a Partial or a Replicate weight gradient, so
with a sequence-sharded output gradient every rank materialises a full [vocab, hidden] gradient
(a Partial, then a Replicate) before it is cut to the rank's rows. At llama3-70b tp=8 that is a
transient 16-bit and fp32 copy of the whole embedding (2 + 4 GiB) on the first pipeline stage.
torchtitan's plan (`tok_embeddings: RowwiseParallel(input_layouts=Replicate(),
output_layouts=Shard(1))`, torchtitan/models/llama3/parallelize.py) goes through the same path.

Megatron-LM's `VocabParallelEmbedding` (megatron/core/tensor_parallel/layers.py) instead masks
the ids outside the rank's rows, looks up locally, zeroes the masked rows and reduces (all-reduce,
or reduce-scatter to the sequence shard under sequence parallel); backward is the local
embedding backward on the local rows. `use_vocab_parallel_lookup` does that here, keeping
RowwiseParallel for placing the weight and for the output collective: the lookup returns a
Partial DTensor, which RowwiseParallel's output hook redistributes (reduce-scatter to Shard(1)
or all-reduce to Replicate); in backward that redistribution hands the lookup the full-sequence
output gradient (an all-gather), and the weight gradient is a Shard(0) DTensor of the local rows.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard


def _local_ids(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids shifted into the rank's rows with the others pointing at row 0, mask of the others)."""
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill_(outside, 0), outside


class _VocabParallelLookup(torch.autograd.Function):
    """out[i] = weight[ids[i] - start] for ids in the rank's rows, 0 elsewhere.

    Saves only the token ids (what nn.Embedding saves, and what the planner counts:
    plan/activations.py's embedding_saved_bytes); the shifted ids and the mask are recomputed."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
        local, outside = _local_ids(ids, start, weight.shape[0])
        ctx.save_for_backward(ids)
        ctx.start, ctx.rows = start, weight.shape[0]
        return F.embedding(local, weight).masked_fill_(outside.unsqueeze(-1), 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        local, outside = _local_ids(ids, ctx.start, ctx.rows)
        grad = grad.masked_fill(outside.unsqueeze(-1), 0)  # other ranks' tokens add nothing here
        weight_grad = torch.ops.aten.embedding_dense_backward(grad, local, ctx.rows, -1, False)
        return None, weight_grad, None


def _forward(self: nn.Embedding, ids: Any) -> Any:
    weight = self.weight
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        return nn.Embedding.forward(self, ids)  # not vocab-sharded over one mesh dim: DTensor's own path
    mesh = weight.device_mesh
    local_ids = ids.to_local() if isinstance(ids, DTensor) else ids  # Replicate: every rank has all ids
    # Shard(0) splits like torch.chunk: ceil(vocab / tp) rows per rank, the last ranks may hold fewer.
    rows_per_rank = -(-weight.shape[0] // mesh.size())
    if rows_per_rank * (mesh.size() - 1) >= weight.shape[0]:
        return nn.Embedding.forward(self, ids)  # a rank with no rows (tiny vocab): same test on every rank
    start = mesh.get_local_rank() * rows_per_rank
    out = _VocabParallelLookup.apply(local_ids, weight.to_local(), start)
    # Each rank holds its rows' contribution: the sum over tp is the embedding (Partial).
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


def use_vocab_parallel_lookup(embedding: nn.Embedding) -> None:
    """Run `embedding` (already parallelised with RowwiseParallel, weight Shard(0)) as a
    Megatron-style vocab-parallel lookup, so its backward computes only the local rows' gradient."""
    embedding.forward = types.MethodType(_forward, embedding)  # type: ignore[method-assign]
