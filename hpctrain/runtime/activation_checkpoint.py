"""Activation checkpointing per transformer block: none, selective or full.

- full: each block keeps only its input; its whole forward is recomputed in backward.
- selective: each block is checkpointed with an op-level policy (PyTorch selective activation
  checkpointing) that SAVES the outputs of matrix multiplies, attention (SDPA) and collectives and
  RECOMPUTES everything else (norms, RoPE, activation functions, residual adds). The expensive
  FLOPs and the communication are never repeated; the many cheap element-wise activations, which
  are most of the memory of a block at small hidden sizes, are. This is torchtitan's "op" policy
  and Megatron's spirit of recomputing what is cheap per byte.

The mode is a flag on `TransformerBlock` (its forward calls `torch.utils.checkpoint`), not a
wrapper module, so parameter and state-dict names are unchanged by checkpointing.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hpctrain.errors import ConfigError
from hpctrain.runtime.model import AC_MODES, TransformerBlock


def _saved_ops() -> set[Any]:
    aten = torch.ops.aten
    ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.linear.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    cudnn = getattr(aten, "_scaled_dot_product_cudnn_attention", None)
    if cudnn is not None:
        ops.add(cudnn.default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None:
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"):
            op = getattr(functional, name, None)
            if op is not None:
                ops.add(op.default)
    return ops


def _policy(saved: set[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(partial(_policy, _saved_ops()))


def apply_ac(modules: nn.Module | Iterable[nn.Module], mode: str) -> None:
    """Set the checkpointing mode of every TransformerBlock in `modules` (in place)."""
    if mode not in AC_MODES:
        raise ConfigError(
            f"train.activation_checkpointing: got {mode!r}; valid: {', '.join(AC_MODES)} "
            "(resolve 'auto' with `hpctrain plan`)"
        )
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    for root in roots:
        for block in root.modules():
            if isinstance(block, TransformerBlock):
                block.ac_mode = mode
                block.ac_context_fn = _selective_context if mode == "selective" else None
