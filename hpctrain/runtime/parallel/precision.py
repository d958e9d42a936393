"""Mixed precision outside FSDP (autocast), dynamic loss scaling for fp16, and the SDPA kernel choice.

With FSDP2 applied, its MixedPrecisionPolicy does the casting (see fsdp.py); without it
(dp == 1, no offload) `autocast` runs matmuls in bf16/fp16 while the parameters, the master
weights, stay fp32.

fp16 needs loss scaling. `torch.amp.GradScaler` is bound to an optimizer and unscales inside
`unscale_(optimizer)`; here the backward may run inside a pipeline schedule (the scale goes into the
loss function) and gradients are DTensor shards spread over pipeline stages, so the inf/nan check
must agree across the whole world. `LossScaler` is the same algorithm (same defaults, same fused
`_amp_foreach_non_finite_check_and_unscale_` kernel) applied to local gradient shards with one
world-wide all-reduce of the found-inf flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

# train.attention_kernel -> SDPA's backends (torch.nn.attention.sdpa_kernel); None: torch chooses. On the CPU
# FLASH_ATTENTION is torch's CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu); MATH is the
# reference composite that materialises the [seq, seq] scores (the planner's "materialized" kernel).
SDPA_BACKENDS: dict[str, list[SDPBackend] | None] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


def autocast_context(device: torch.device, precision: str, fsdp_casts: bool) -> Any:
    """autocast for bf16/fp16 when FSDP does not cast the parameters; a no-op otherwise."""
    if precision == "fp32" or fsdp_casts:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank stores: the local shard of a DTensor, the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class LossScaler:
    """Dynamic loss scaling: start at 2**16, halve on inf/nan (and skip the step), double after
    `growth_interval` clean steps — torch.amp.GradScaler's defaults."""

    def __init__(self, comm_device: torch.device, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.found_inf = False
        self.comm_device = comm_device

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale; return (and remember) whether any rank saw inf/nan."""
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        found = torch.zeros(1, device=self.comm_device)
        by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_device_dtype.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device_dtype.items():
            flag = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            found += flag.to(self.comm_device)
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self.found_inf = bool(found.item() > 0)
        return self.found_inf

    def update(self) -> None:
        """After the optimizer step (taken or skipped): adjust the scale."""
        if self.found_inf:
            self.scale *= 0.5
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


__all__ = ["SDPA_BACKENDS", "LossScaler", "autocast_context", "local_tensor", "sdpa_kernel"]
