"""Memory-efficient sequence parallelism: keep the sequence shard, all-gather again in backward.

Under sequence parallelism the normalised input of attention (and of the FFN) is a sequence shard
[b, s/tp, h]; it is all-gathered to [b, s, h] for the column-parallel matmuls (wq/wk/wv, w1/w3),
and each of those matmuls saves that full-sequence input for its weight gradient. Korthikanti et
al. 2022 (section 4.2.2, and Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`) keep
only the shard and redo the all-gather in backward: the saved bytes of that tensor drop by tp for
one extra all-gather per region per backward (which Megatron overlaps with the input-gradient
matmul).

Here this is done with torch's own facility, `torch.autograd.graph.saved_tensors_hooks`, around
the module whose input is gathered: every saved tensor that shares the gathered tensor's storage
is packed as a reference to the shard (plus its view geometry); the first unpack in backward
gathers again and the few matmuls that saved it share that one gathered copy. Other tensors go
to whatever hooks were active outside (so saved-tensor measurement still sees everything).

Only without activation checkpointing: with "full" the block keeps only its input anyway, and the
"selective" policy (activation_checkpoint.py) recomputes the all-gather instead of saving it.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

_HOOKS_ATTR = "_hpctrain_sp_hooks"
# Set by activation_checkpoint.apply_ac on the gathered modules of a checkpointed block.
CHECKPOINTED_ATTR = "_hpctrain_checkpointed"


class _Regather:
    """The shard behind one gathered tensor; gathers at most once per backward, and gives the matmuls that
    saved the same view of it (wq, wk and wv each save the gathered input as [b*s, h]) one tensor for it."""

    def __init__(self, shard: DTensor, ptr: int) -> None:
        self.shard = shard
        self.ptr = ptr
        self.pending = 0  # packed references not yet unpacked
        self.full: torch.Tensor | None = None
        self.views: dict[Any, torch.Tensor] = {}  # (geometry, DTensor spec) -> the tensor unpacked for it

    def local_full(self) -> torch.Tensor:
        if self.full is None:
            self.full = self.shard.redistribute(self.shard.device_mesh, [Replicate()]).to_local()
        return self.full

    def view(self, geometry: tuple[Any, ...], spec: tuple[Any, ...] | None) -> torch.Tensor:
        """The gathered tensor as one saved view of it; a DTensor again when `spec` (mesh, placements, shape,
        stride) says it was one. Built once per backward for each distinct view (DTensor.from_local is ~0.2 ms
        of Python on the CPU; issue 23 item 8)."""
        key = (geometry, spec)
        found = self.views.get(key)
        if found is None:
            size, stride, offset = geometry
            local = self.local_full().as_strided(size, stride, offset)
            if spec is None:
                found = local
            else:
                mesh, placements, shape, dstride = spec
                found = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=dstride)
            self.views[key] = found
        return found

    def release(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.full = None  # the last matmul that needs it has it: drop the gathered copy
            self.views.clear()


class _Packed:
    """A saved tensor replaced by (shard, view geometry)."""

    def __init__(self, source: _Regather, t: torch.Tensor) -> None:
        local = t.to_local() if isinstance(t, DTensor) else t
        self.source = source
        self.geometry = (tuple(local.shape), tuple(local.stride()), local.storage_offset())
        self.spec = (t.device_mesh, tuple(t.placements), t.shape, t.stride()) if isinstance(t, DTensor) else None
        self.requires_grad = t.requires_grad
        source.pending += 1

    def unpack(self) -> torch.Tensor:
        out = self.source.view(self.geometry, self.spec)
        self.source.release()
        return out


def _outer_hooks() -> tuple[Any, Any]:
    # A private accessor (torch 2.13 has it); without it the outer hooks are not chained, which
    # only hides these tensors from an outer measurement: checkpointed blocks never get here.
    getter = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    top = getter(False) if getter is not None else None
    if top is None:
        return (lambda t: t), (lambda p: p)
    return top


def _pre_hook(mesh: DeviceMesh, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x = args[0]
    shard = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    gathered = shard.redistribute(mesh, [Replicate()])
    if not torch.is_grad_enabled() or getattr(module, CHECKPOINTED_ATTR, False):
        return (gathered, *args[1:])
    # cast: torch's stubs type detach() as returning Tensor; on a DTensor it returns a DTensor.
    source = _Regather(cast(DTensor, shard.detach()), gathered.to_local().untyped_storage().data_ptr())
    outer_pack, outer_unpack = _outer_hooks()

    def pack(t: torch.Tensor) -> Any:
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type != "meta" and local.untyped_storage().data_ptr() == source.ptr:
            # Pass the shard through the outer hooks once, so a measurement counts it.
            return ("regather", _Packed(source, t), outer_pack(source.shard.to_local()))
        return ("outer", outer_pack(t))

    def unpack(packed: Any) -> torch.Tensor:
        if packed[0] == "regather":
            return packed[1].unpack()
        return outer_unpack(packed[1])

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    hooks.__enter__()
    setattr(module, _HOOKS_ATTR, hooks)
    return (gathered, *args[1:])


def _post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    hooks = getattr(module, _HOOKS_ATTR, None)
    if hooks is not None:
        setattr(module, _HOOKS_ATTR, None)
        hooks.__exit__(None, None, None)


def gather_sequence_input(module: nn.Module, mesh: DeviceMesh) -> None:
    """`module(x, ...)` receives x as a sequence shard (Shard(1) over `mesh`) and runs on the
    all-gathered, replicated x; its backward all-gathers x again instead of keeping it."""
    module.register_forward_pre_hook(lambda m, a: _pre_hook(mesh, m, a))
    module.register_forward_hook(_post_hook, always_call=True)


class SequenceShards:
    """The ranks that split one micro-batch's sequences at a MoE layer's input: the tp group under sequence
    parallelism (tensor.py sets `MoE.sequence`), or the cp x tp ranks under context parallelism (context.py). Each
    routes the tokens it holds, so what one process computes over the whole micro-batch (the balancing loss's load
    fractions, the capacity's slot positions) needs the counts of the other shards. Small integer tensors, no
    gradient; torch's functional collectives.

    `positions`: the global positions (within a sequence) of this rank's tokens, in its local order (context
    parallelism's head and tail chunks, then this tp rank's slice of them), made of aligned runs of `block`
    consecutive positions (the same `block` on every rank of the group); None: the sequence cut into `size`
    contiguous shards in rank order (sequence parallelism alone). `loss_shards`: how many of the ranks' balancing-
    loss terms add up to one loss: the tp ranks (the sequence shards of one loss); each cp rank's term is a loss
    of its own tokens, which FSDP averages over dp x cp as it does the language-model loss's gradients."""

    def __init__(self, mesh: DeviceMesh, positions: list[int] | None = None, block: int = 0,
                 loss_shards: int | None = None) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.loss_shards = self.size if loss_shards is None else loss_shards
        self._blocks: tuple[int, list[int]] | None = None if positions is None else (block, _blocks(positions, block))
        self._on_device: dict[tuple[int, torch.device], torch.Tensor] = {}

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the group's ranks."""
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), "sum", self.group))

    def blocks(self, local_len: int, device: torch.device) -> tuple[int, torch.Tensor, int]:
        """(g, index, total): this rank's `local_len` tokens of a sequence as blocks of g consecutive positions,
        each block's index among the sequence's `total` blocks of g ([local_len / g] int64, in local order)."""
        if self._blocks is None:  # contiguous shards in rank order: one block each
            g, indices = local_len, [self.rank]
        else:
            g, indices = self._blocks
        key = (local_len, device)
        if key not in self._on_device:
            self._on_device[key] = torch.tensor(indices, dtype=torch.int64, device=device)
        return g, self._on_device[key], local_len * self.size // g


def _blocks(positions: list[int], block: int) -> list[int]:
    """The block index (first position / block) of each piece of `block` positions; each piece must be an aligned
    run of consecutive positions."""
    pieces = [positions[i:i + block] for i in range(0, len(positions), block)]
    if block < 1 or any(len(p) != block or p[0] % block or p != list(range(p[0], p[0] + block)) for p in pieces):
        raise ValueError(f"positions {positions[:8]}... are not aligned runs of {block}")
    return [p[0] // block for p in pieces]
