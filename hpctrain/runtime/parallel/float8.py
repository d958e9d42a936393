"""FP8 training (`train.precision: fp8`) with torchao's float8 linears (recipe mxfp8: mxfp8.py's MXLinear).

`apply_float8` swaps each eligible `nn.Linear` of a model part for torchao's `Float8Linear`
(`convert_to_float8_training`): its forward casts the input and the weight to float8 (e4m3) with
dynamic scales, its backward the output gradient (e5m2), and the three GEMMs run in fp8
(`torch._scaled_mm`; with `train.fp8.emulate` torchao dequantises and multiplies in high precision,
which any device can do). The parameter stays an ordinary fp32 `weight` under its usual name: the
master weights, the optimizer and the checkpoints (DCP state-dict names) do not change.

Eligible (torchtitan's float8 converter, components/quantization/float8.py, does the same): not the
output head (`output`: its logits feed the loss), not the MoE router (`router`: its top-k is sensitive to
rounding and it is small), and both widths at least `train.fp8.min_width` and multiples of 16 (the fp8
GEMM's tile; torchao's `_auto_filter_for_recipe` requires it too). Everything else runs in
`train.fp8.high_precision` (bf16, as torchtitan's mixed precision; fp32 for exact parity checks).

Where it sits: after the pipeline split, before TP (build.py), on the meta device; torchtitan converts in
its model-converter step before `parallelize`, for the same reason: the TP styles and FSDP2 then see the
Float8Linear modules.
- TP: tensorwise uses torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel` (the sharded
  activations cross the tp group in fp8, and the scales are computed over the whole DTensor, so every
  layout casts with the scale one process would); rowwise keeps the plain styles, as torchtitan does
  (torchao's float8 TP styles assume tensorwise scaling).
- FSDP2: tensorwise all-gathers the weights in fp8 (`enable_fsdp_float8_all_gather`), and after each
  optimizer step `precompute_float8_dynamic_scale_for_fsdp` computes every weight's scale in one
  all-reduce (torchtitan's `post_optimizer_hook`); `Training` also runs it before the first step of a
  start. Without it FSDP's pre-all-gather cast scales each shard by an amax reduced over dp only, so
  under tp x dp each tp shard got its own scale (measured: losses 7e-5 off one process at step 1); the
  precomputed scale is the whole DTensor's, the one a single process uses.
- Scales are dynamic: tensorwise takes one amax over a micro-batch's activations (and output
  gradients), so a layout matches one process when it casts the same micro-batches (the parity test).
- LoRA: the frozen base's GEMM runs in fp8 (model/lora.py keeps the Float8Linear forward under the
  adapters'); the adapters themselves are small and stay in high precision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.runtime.parallel import mxfp8

if TYPE_CHECKING:
    from hpctrain.config.training import Fp8Config, TrainConfig

# Module names (FQN components) that stay in high precision whatever their width.
SKIPPED_NAMES = ("output", "router")
FP8_TILE = 16


def compute_precision(train: TrainConfig) -> str:
    """The precision of everything that is not an fp8 GEMM: train.precision, or fp8's high precision."""
    return train.fp8.high_precision if train.precision == "fp8" else train.precision


def _torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError("train.precision: fp8 needs torchao, which is not installed on this node; "
                          "pip install 'hpctrain[fp8]', or set train.precision: bf16") from None
    return float8


def eligible(min_width: int, tile: int = FP8_TILE) -> Callable[[nn.Module, str], bool]:
    """torchao's module_filter_fn: True for the linears that become Float8Linear (or MXLinear: `tile` is then
    mxfp8.MX_BLOCK x tp, whole MX blocks on every tp shard)."""
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(part in SKIPPED_NAMES for part in fqn.split(".")):
            return False
        widths = (module.in_features, module.out_features)
        return all(w >= min_width and w % tile == 0 for w in widths)
    return keep


def float8_config(fp8: Fp8Config, fsdp: bool) -> Any:
    """torchao's Float8LinearConfig for the recipe; fp8 all-gather under FSDP for tensorwise."""
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(fp8.recipe)
    return dataclasses.replace(config, emulate=bool(fp8.emulate),
                               enable_fsdp_float8_all_gather=fsdp and fp8.recipe == "tensorwise")


def apply_float8(module: nn.Module, fp8: Fp8Config, *, fsdp: bool, tp: int = 1) -> list[str]:
    """Convert `module`'s eligible linears in place (on meta, before TP); returns their names. Recipe mxfp8:
    MXLinear (runtime/parallel/mxfp8.py), blocks of 32 on every tp shard; the others: torchao's Float8Linear."""
    if fp8.recipe == "mxfp8":
        return mxfp8.convert(module, eligible(fp8.min_width, mxfp8.MX_BLOCK * tp), bool(fp8.emulate))
    float8 = _torchao()
    keep = eligible(fp8.min_width)
    names = [name for name, sub in module.named_modules() if keep(sub, name)]
    if names:
        float8.convert_to_float8_training(module, config=float8_config(fp8, fsdp), module_filter_fn=keep)
    return names


def precompute_scales(model_parts: Iterable[nn.Module]) -> None:
    """After the optimizer step: the fp8 all-gather's weight scales, one all-reduce per part (tensorwise, FSDP)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
