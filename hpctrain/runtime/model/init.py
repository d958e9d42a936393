"""Sharded, layout-independent initialisation: each rank fills only its own shard of each parameter.

The seam is a *fill*: `fill(name, full_shape, index) -> tensor`, where `name` is the full-model
parameter name (`layers.3.attention.wq.weight`; a tied head passes `tok_embeddings.weight`),
`full_shape` the full parameter's shape and `index` one slice per dimension, a box in global
coordinates inside this rank's local shard. It returns that box's values (CPU or device, any float
dtype); `init_parameters` copies them into the parameter, which may be a plain tensor, a DTensor
(tensor parallel) or an FSDP2-sharded DTensor. No full parameter ever exists on a rank.

`init_parameters` asks for a large shard in row blocks of at most `max_chunk_bytes` (boxes aligned
to the global tile grid below, so each box is drawn exactly once): the copy then never needs a
second shard-sized buffer. A fill must therefore answer any box, not only whole shards.

`random_fill(seed, layers)` is the default fill, a tiled draw. Each parameter is cut into fixed
tiles that depend only on its full shape (`tile_shape`); tile k of parameter `name` is drawn from a
generator seeded by (seed, name, k). A rank draws only the tiles that overlap its box and copies
the overlap, one tile at a time. The values of a parameter are thus the same on every layout (one
process, any TP/PP/DP split), which the parity tests rely on. Tiles are small against a shard
(at most TILE_NUMEL elements, rows a power of two at most 1/TILE_ROW_SPLITS of the rows, columns
at most TILE_COLS), so shard edges at power-of-two splits fall on tile edges and the draw costs
about one `torch.randn` of the shard (bench/init_memory.py measures it on llama3-8b at tp=8).
Values depend on the generator's device type: a CUDA draw differs from a CPU draw of the same seed.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

ShardFill = Callable[[str, tuple[int, ...], tuple[slice, ...]], torch.Tensor]

INIT_STD = 0.02
TILE_COLS = 256
TILE_NUMEL = 65536
TILE_ROW_SPLITS = 64
MAX_CHUNK_BYTES = 4 * 2**20


def canonical_name(name: str, tied: bool) -> str:
    """The name whose values a parameter takes: a tied head takes the embedding's."""
    return "tok_embeddings.weight" if tied and name == "output.weight" else name


def shard_index(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(full shape, this rank's local shard as one slice per dim in global coordinates).

    A plain tensor is its own full tensor. A DTensor's local shard must be one box of the full
    tensor (true for Shard/Replicate and FSDP2's strided sharding on top of TP)."""
    from torch.distributed.tensor import DTensor

    full_shape = tuple(int(n) for n in param.shape)
    if not isinstance(param, DTensor):
        return full_shape, tuple(slice(0, n) for n in full_shape)
    local_shape, offset = _local_shape_and_offset(param)
    actual = tuple(param.to_local().shape)
    if local_shape != actual:
        raise RuntimeError(f"a DTensor of shape {full_shape} with placements {param.placements}: its local shard "
                           f"{actual} is not the box {local_shape} at {offset}; sharded initialisation cannot fill it")
    return full_shape, tuple(slice(o, o + n) for o, n in zip(offset, local_shape))


def _local_shape_and_offset(param: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Private in torch, but the function DCP itself places shards with (same signature in 2.6 and 2.13);
    # imported at the first init, so that a torch that moves it fails there with a clear ImportError.
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    # It computes with small real tensors: under FakeTensorMode (the benches' dry builds) those would
    # be fake and their values unreadable, so step out of the mode for the arithmetic.
    with unset_fake_temporarily():
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(int(n) for n in shape), tuple(int(o) for o in offset)


def init_parameters(model: nn.Module, fill: ShardFill, max_chunk_bytes: int | None = MAX_CHUNK_BYTES,
                    select: Callable[[str], bool] | None = None) -> None:
    """Fill every parameter's local shard of `model` from `fill`; see the module docstring.

    `model.args.tie_embeddings` (when present) maps a tied head to the embedding's name.
    `max_chunk_bytes=None` asks for each shard in one call; `select(name)` False leaves a
    parameter as it is (LoRA's adapters, which lora.init_lora sets)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    tied = bool(getattr(getattr(model, "args", None), "tie_embeddings", False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if select is not None and not select(name):
                continue
            full_shape, index = shard_index(param)
            local = param.to_local() if isinstance(param, DTensor) else param
            if local.numel() == 0 or isinstance(local, FakeTensor):
                continue  # nothing to hold; or a dry build's fake tensor (no values, only memory)
            source = canonical_name(name, tied)
            for box in _chunks(full_shape, index, local.element_size(), max_chunk_bytes):
                values = fill(source, full_shape, box)
                rows = slice(box[0].start - index[0].start, box[0].stop - index[0].start)
                target = local[rows] if local.dim() else local
                if tuple(values.shape) != tuple(target.shape):
                    raise RuntimeError(f"the fill returned {tuple(values.shape)} for {source} {box}; "
                                       f"expected {tuple(target.shape)}")
                target.copy_(values)


def _chunks(full_shape: tuple[int, ...], index: tuple[slice, ...], element_bytes: int,
            max_chunk_bytes: int | None) -> list[tuple[slice, ...]]:
    """Row blocks of the box `index`, each under max_chunk_bytes, cut on the tile grid's rows."""
    if not index or max_chunk_bytes is None:
        return [index]
    row_bytes = element_bytes * math.prod(s.stop - s.start for s in index[1:])
    tile_rows = tile_shape(full_shape)[0]
    step = max(1, max_chunk_bytes // max(row_bytes, 1) // tile_rows) * tile_rows
    first, stop = index[0].start, index[0].stop
    cuts = [first] + list(range((first // step + 1) * step, stop, step)) + [stop]
    return [(slice(a, b), *index[1:]) for a, b in zip(cuts, cuts[1:])]


def tile_shape(full_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tile of a parameter of this full shape (a function of the shape only, never of the layout).

    Last dim: up to TILE_COLS columns; first dim (2-D): a power of two of rows, at most
    rows/TILE_ROW_SPLITS and TILE_NUMEL elements in all. 3-D and up: one leading index at a time
    (an expert), the rest tiled as above, so a split of the experts or of their rows by a power of
    two falls on tile edges."""
    if not full_shape:
        return ()
    if len(full_shape) > 2:  # stacked matrices (MoE experts [E, out, in]): each matrix tiled as a 2-D one
        return (1, *tile_shape(full_shape[1:]))
    cols = min(full_shape[-1], TILE_COLS)
    if len(full_shape) == 1:
        return (cols,)
    fit = max(1, TILE_NUMEL // max(cols, 1))
    split = max(1, full_shape[0] // TILE_ROW_SPLITS)
    rows = 1 << (min(fit, split).bit_length() - 1)  # the largest power of two <= both
    return (rows, *([1] * (len(full_shape) - 2)), cols)


def param_seed(seed: int, name: str) -> int:
    """A generator seed from the run seed and a parameter's full-model name (stable across runs)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def tile_seed(seed: int, name: str, tile: int) -> int:
    """The seed of tile number `tile` (row-major over the tile grid) of parameter `name`."""
    return (param_seed(seed, name) * 1_000_033 + tile * 2_654_435_761) % (2**63)


def init_std(name: str, layers: int) -> float | None:
    """The normal std of parameter `name`; None: a norm weight, initialised to ones."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared.w2.weight")):
        return INIT_STD / math.sqrt(2 * layers)  # GPT-2 residual scaling
    return INIT_STD


def random_fill(seed: int, layers: int, device: torch.device | str | None = None) -> ShardFill:
    """The default fill: N(0, init_std) drawn tile by tile on `device` (default CPU), norms ones."""
    draw_device = torch.device(device or "cpu")

    def fill(name: str, full_shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        shape = tuple(s.stop - s.start for s in index)
        std = init_std(name, layers)
        if std is None:
            return torch.ones(shape, device=draw_device)
        out = torch.empty(shape, device=draw_device)
        _draw_tiles(out, seed, name, full_shape, index, std)
        return out

    return fill


def _draw_tiles(out: torch.Tensor, seed: int, name: str, full_shape: tuple[int, ...],
                index: tuple[slice, ...], std: float) -> None:
    tile = tile_shape(full_shape)
    grid = [math.ceil(n / t) for n, t in zip(full_shape, tile)]
    ranges = [range(s.start // t, math.ceil(s.stop / t)) if s.stop > s.start else range(0)
              for s, t in zip(index, tile)]
    generator = torch.Generator(device=out.device)
    buffers: dict[tuple[int, ...], torch.Tensor] = {}  # one per tile extent: no allocation per tile
    for coords in itertools.product(*ranges):
        number = 0
        for c, g in zip(coords, grid):
            number = number * g + c
        starts = [c * t for c, t in zip(coords, tile)]
        extent = tuple(min(t, n - s) for s, t, n in zip(starts, tile, full_shape))
        generator.manual_seed(tile_seed(seed, name, number))
        values = buffers.get(extent)
        if values is None:
            values = buffers[extent] = torch.empty(extent, device=out.device)
        values.normal_(0.0, std, generator=generator)  # the whole tile, contiguous: the same on every rank
        # The overlap of this tile with the box, in tile and in box coordinates.
        lo = [max(s, i.start) for s, i in zip(starts, index)]
        hi = [min(s + e, i.stop) for s, e, i in zip(starts, extent, index)]
        src = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, starts))
        dst = tuple(slice(a - i.start, b - i.start) for a, b, i in zip(lo, hi, index))
        out[dst].copy_(values[src])
