"""LoRA (Hu et al. 2021): frozen base weights, a trained low-rank update per targeted projection.

A targeted `nn.Linear` (wq wk wv wo w1 w2 w3 of every block) becomes a `LoraLinear`, the same module
with two more parameters and a forward that adds the update:

    y = x W^T + (alpha / rank) * dropout(x) A^T B^T        A: [rank, in], B: [out, rank]

Names: `layers.N.attention.wq.weight` is unchanged (checkpoints, `model.init_from` and export see the
base under its usual name); the adapters are `layers.N.attention.wq.lora_A` / `.lora_B`.
Initialisation mirrors PEFT's `LoraLayer.reset_lora_parameters` (init_lora_weights=True):
A ~ kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)), and B = 0, so training starts
from the base model exactly. A is drawn full size from a generator seeded by (seed, name) on every rank,
each keeping its box (adapters are small), so every layout starts from the same adapters.

Every other parameter (the projections' W, embeddings, norms, head) is frozen (requires_grad
False): no gradient, no optimizer state, not in checkpoints (`StateDictOptions(ignore_frozen_params)`:
the base is rebuilt on resume from the seed, or from model.init_from, both deterministic). The frozen
base stays in fp32 like every runtime parameter; under FSDP it is sharded and gathered with its
block (FSDP2 handles mixed requires_grad in one unit: only parameters with gradients are
reduce-scattered, checked in FSDPParamGroup), so no unit of its own is needed.

Tensor parallelism: the adapters are applied after `apply_tp`, as DTensors on the tp mesh, and
the update is computed in the same DTensor program as the base matmul, before the module's output
hook, so it rides on the base's own communication:
- column-parallel W (wq wk wv w1 w3; Shard(0)): A replicated, B Shard(0) on the out dim; x A^T is
  replicated, the update comes out sharded on the out dim like x W^T.
- row-parallel W (wo w2; Shard(1)): A Shard(1) on the in dim, B replicated; x A^T is a partial sum,
  and the update stays Partial until the base's reduction (all-reduce or reduce-scatter) sums both.
Gradients of replicated adapters come out Partial; `Training._match_grad_placements` reduces them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.runtime.model.init import param_seed, shard_index
from hpctrain.runtime.model.transformer import ModelArgs, Transformer

if TYPE_CHECKING:
    from hpctrain.config.lora import LoraConfig

# Which projections are column- and row-parallel under TP (parallel/tensor.py's plan).
MODULE_OF = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
             "w1": "feed_forward", "w2": "feed_forward", "w3": "feed_forward"}
ROWWISE = ("wo", "w2")


class LoraLinear(nn.Linear):
    """nn.Linear + a low-rank update (set up by `apply_lora`; never constructed directly)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scaling: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The base class's matmul: nn.Linear's (no bias here), or torchao's Float8Linear's under
        # train.precision fp8 (`_lora_class`), so a frozen base computes in fp8 as well.
        base = super().forward(x)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        # Scale the rank-sized intermediate, not the output: fewer elements, nothing saved for it.
        return base + F.linear(F.linear(h, self.lora_A) * self.lora_scaling, self.lora_B)


def lora_targets(model_args: ModelArgs, cfg: LoraConfig) -> list[str]:
    """The projections adapted in this model (w3 exists with swiglu only)."""
    return [t for t in cfg.targets if t != "w3" or model_args.activation == "swiglu"]


def apply_lora(model: Transformer, cfg: LoraConfig, tp_mesh: Any = None) -> None:
    """Freeze `model` (a full model or stage, on meta, after apply_tp) and add adapters in place."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.layers.values():
        for target in lora_targets(model.args, cfg):
            linear = getattr(getattr(block, MODULE_OF[target]), target)
            _add_adapters(linear, target, cfg, tp_mesh)


def _add_adapters(linear: nn.Linear, target: str, cfg: LoraConfig, tp_mesh: Any) -> None:
    out_features, in_features = linear.weight.shape  # DTensor: the global shape
    device = linear.weight.device
    a = torch.empty(cfg.rank, in_features, device=device)
    b = torch.empty(out_features, cfg.rank, device=device)
    if tp_mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        rowwise = target in ROWWISE
        a_place, b_place = (Shard(1), Replicate()) if rowwise else (Replicate(), Shard(0))
        # On meta: placements only, no data and no communication (materialised by to_empty).
        a = DTensor.from_local(_local_part(a, a_place, tp_mesh), tp_mesh, [a_place], run_check=False,
                               shape=a.shape, stride=a.stride())
        b = DTensor.from_local(_local_part(b, b_place, tp_mesh), tp_mesh, [b_place], run_check=False,
                               shape=b.shape, stride=b.stride())
    linear.__class__ = _lora_class(type(linear))
    assert isinstance(linear, LoraLinear)  # true after the swap; lets mypy see the adapter fields
    linear.register_parameter("lora_A", nn.Parameter(a))
    linear.register_parameter("lora_B", nn.Parameter(b))
    linear.lora_scaling = cfg.alpha / cfg.rank
    linear.lora_dropout = float(cfg.dropout)


_LORA_CLASSES: dict[type, type] = {nn.Linear: LoraLinear}


def _lora_class(base: type) -> type:
    """LoraLinear over `base`: itself for nn.Linear, a subclass of both for another Linear (Float8Linear)."""
    if base not in _LORA_CLASSES:
        _LORA_CLASSES[base] = type(f"Lora{base.__name__}", (LoraLinear, base), {})
    return _LORA_CLASSES[base]


def _local_part(full: torch.Tensor, placement: Any, mesh: Any) -> torch.Tensor:
    if placement.is_replicate():
        return full
    pieces = torch.chunk(full, mesh.size(), dim=placement.dim)
    return pieces[mesh.get_local_rank()].contiguous()


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def init_lora(model: nn.Module, seed: int) -> None:
    """PEFT's initialisation (module docstring), layout independent; after the base's init/load.

    A is drawn full size on every rank (rank x in_features: small beside any base shard) and each
    rank keeps its box of it (init.shard_index); B is zeros."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter(name):
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            if name.endswith(".lora_B"):
                local.zero_()
                continue
            full_shape, index = shard_index(param)
            bound = 1.0 / math.sqrt(full_shape[1])  # kaiming_uniform_(a=sqrt(5)): gain*sqrt(3/fan_in)
            generator = torch.Generator().manual_seed(param_seed(seed, name))
            full = torch.empty(full_shape).uniform_(-bound, bound, generator=generator)
            local.copy_(full[index])

