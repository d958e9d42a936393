"""train.fp8.recipe mxfp8: Blackwell's microscaled FP8 linears through torchao's MX training GEMM.

MXFP8 (OCP Microscaling Formats v1.0): e4m3 elements in blocks of 32 along a GEMM's reduction dimension K, each
block with one power-of-two E8M0 scale; Blackwell's tensor cores read the scales inside the MMA (sm_100). For one
linear torchao's `_to_mxfp8_then_scaled_mm` (torchao.prototype.moe_training.mxfp8_linear, the function behind its
MXFP8Linear and its MXFP8 training config) casts the input and the weight with blocks along K for the forward GEMM,
the output gradient and the weight with blocks along the output width for the input gradient, and the output
gradient and the input with blocks along the tokens for the weight gradient; scales are RCEIL (cuBLAS's UE8M0
rule, torchao's default for MXFP8 training). With `train.fp8.emulate` torchao computes the same casts in plain torch
ops and multiplies the dequantised blocks (KernelPreference.EMULATED): any device, tests on the CPU.

`MXLinear` is an nn.Linear whose class is swapped in place (the parameter keeps its name and fp32 master dtype, so
checkpoints, FSDP2 and LoRA see an ordinary linear; FSDP2 all-gathers the weight in 16 bits). Scales are per block,
so nothing needs an amax over a tensor: under TP each rank casts its own shard with the scales one process would
use, provided the blocks stay inside a shard. The column-parallel weight [out/tp, in] runs its forward over the
whole K and its input gradient over K = out/tp; the row-parallel one over K = in/tp: both widths must be multiples
of 32 x tp (`eligible`), and the micro-batch's tokens on a rank (the weight gradient's K) a multiple of 32
(config/job.py checks them). The sharded GEMM runs on the local tensors (`_sharded`), DTensor placements around
it as torch's styles expect: column-parallel x Replicate (its gradient Partial), out Shard(last); row-parallel x
Shard(last), out Partial, which the row-parallel style then reduces (all-reduce, or reduce-scatter under sequence
parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hpctrain.errors import ConfigError

MX_BLOCK = 32  # OCP MX v1.0: the MXFP8 formats' block size


def _mx_ops() -> tuple[Any, Any, Any]:
    """torchao's MX GEMM, its kernel preference and scale-mode enums (ConfigError without them)."""
    try:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError:
        raise ConfigError("train.fp8.recipe: mxfp8 needs torchao's MX training path (torchao.prototype.moe_training, "
                          "torchao 0.18), which is not installed on this node; pip install 'hpctrain[fp8]', or set "
                          "train.fp8.recipe: tensorwise") from None
    return _to_mxfp8_then_scaled_mm, KernelPreference, ScaleCalculationMode


def mx_matmul(x: torch.Tensor, weight: torch.Tensor, emulate: bool) -> torch.Tensor:
    """x @ weight.T with both (and, in backward, the output gradient) cast to MXFP8 per block of 32 along K."""
    mm, kernel, scale = _mx_ops()
    return mm(x, weight, kernel.EMULATED if emulate else kernel.AUTO, scale.RCEIL)


class MXLinear(nn.Linear):
    """An nn.Linear whose GEMMs run in MXFP8 (set up by `convert`; never constructed directly)."""

    mx_emulate: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.mx_emulate and x.dtype != weight.dtype:
            # torchao's emulation multiplies the dequantised blocks in their own dtypes: a bf16 input (autocast's)
            # against the fp32 master weight of a run without FSDP is a dtype error inside torchao; the emulated
            # GEMM runs in the weight's precision instead (on the GPU the MX kernels take both as they are)
            x = x.to(weight.dtype)
        if isinstance(weight, DTensor):
            out = _sharded(x, weight, self.mx_emulate)
        else:
            out = mx_matmul(x, weight, self.mx_emulate)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _sharded(x: Any, weight: Any, emulate: bool) -> Any:
    """The GEMM of a tensor-parallel weight on the local shards (module docstring). Column-parallel: x replicated,
    its local gradient one rank's share of the sum (Partial, reduced by the style's input redistribution in
    backward), out sharded on the last dimension; row-parallel: x sharded on the last dimension, out Partial."""
    (placement,) = weight.placements
    mesh, last = weight.device_mesh, x.ndim - 1
    if not isinstance(x, DTensor):
        raise TypeError(f"MXLinear: a tensor-parallel weight ({placement}) needs a DTensor input (torch's "
                        "ColwiseParallel / RowwiseParallel give one); got a plain tensor")
    if placement == Shard(0):
        x_local = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        out_placement: Any = Shard(last)
    elif placement == Shard(1):
        x_local = x.redistribute(mesh, [Shard(last)]).to_local()
        out_placement = Partial()
    else:
        raise TypeError(f"MXLinear: a weight placed {placement} is neither column- nor row-parallel")
    out = mx_matmul(x_local, weight.to_local(), emulate)
    return DTensor.from_local(out, mesh, [out_placement], run_check=False)


def convert(module: nn.Module, keep: Any, emulate: bool) -> list[str]:
    """Swap the class of every linear of `module` that `keep(sub, name)` accepts to MXLinear (on meta, before TP);
    returns their names."""
    _mx_ops()  # refuse before anything changes when torchao's MX path is missing
    names = []
    for name, sub in module.named_modules():
        if type(sub) is nn.Linear and keep(sub, name):
            sub.__class__ = MXLinear
            sub.mx_emulate = bool(emulate)  # type: ignore[assignment]  # an instance attribute over the class default
            names.append(name)
    return names
