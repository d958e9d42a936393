"""Activation checkpointing per transformer block: none, selective or full.

- full: each block keeps only its input; its whole forward is recomputed in backward.
- selective: each block is checkpointed with an op-level policy (PyTorch selective activation
  checkpointing) that SAVES the outputs of matrix multiplies (under TP not those of the
  row-parallel wo/w2, whose reduced outputs are saved instead), attention (SDPA) and reductions and
  RECOMPUTES everything else (norms, RoPE, activation functions, residual adds, and the
  sequence-parallel all-gathers). The expensive
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
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.transformer import AC_MODES, TransformerBlock
from hpctrain.runtime.parallel import ring_attention
from hpctrain.runtime.parallel.sequence import CHECKPOINTED_ATTR


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.linear.default}


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
    # Context parallelism's lower-right causal attention (runtime/parallel/context.py) reaches the
    # memory-efficient kernel through this op on a GPU (torch/nn/attention/bias.py CausalBias._dispatch).
    efficient = getattr(aten, "_efficient_attention_forward", None)
    if efficient is not None:
        ops.add(efficient.default)
    # Context parallelism's ring (runtime/parallel/ring_attention.py): one op, its outputs kept like SDPA's,
    # so the recompute in backward does not pass the K/V around the ring again.
    ops.add(ring_attention.ring_attention._opoverload)
    grouped = getattr(aten, "_grouped_mm", None)  # the MoE experts' GEMMs (runtime/model/moe.py)
    if grouped is not None:
        ops.add(grouped.default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None:
        # Not all_gather_into_tensor: under sequence parallel its output is the full-sequence
        # input of attention / the FFN; recomputing it (one more all-gather in backward) keeps
        # the saved bytes of that tensor at 1/tp, as Megatron-LM does (sequence.py).
        # all_to_all_single: expert parallelism's token exchange, not repeated in backward (torchtitan's
        # selective-AC save list keeps it too, torchtitan/distributed/activation_checkpoint.py).
        for name in ("reduce_scatter_tensor", "all_reduce", "all_to_all_single"):
            op = getattr(functional, name, None)
            if op is not None:
                ops.add(op.default)
    return ops


# > 0 while a row-parallel projection (wo, w2 under TP) runs. Its matmul output is a full-size
# partial sum [b, s, hidden] that only feeds the all-reduce / reduce-scatter; saving it would keep
# 2 x hidden per token per layer whatever tp is, more than all the rest of the layer at tp=8. The
# reduced output is saved instead (1/tp of it under sequence parallel); the price is that the
# recompute in backward runs those two matmuls again.
_row_parallel_depth = 0


def _enter_row_parallel(module: nn.Module, args: Any) -> None:
    global _row_parallel_depth
    _row_parallel_depth += 1


def _leave_row_parallel(module: nn.Module, args: Any, output: Any) -> None:
    global _row_parallel_depth
    _row_parallel_depth -= 1


def _policy(saved: set[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in saved and not (_row_parallel_depth and op in _MATMULS):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _ignore_profiler_ranges() -> None:
    """Let selective checkpointing run profiler ranges instead of counting them as ops.

    Under expert parallelism the routed experts are an FSDP unit inside the checkpointed block
    (expert.py): FSDP's hooks open `record_function` ranges, a different number of them in the
    recomputation than in forward (nothing to all-gather again), and torch's SAC counts each range as a
    dispatched op and fails on the mismatch. The ranges have no tensor outputs to save or recompute;
    `SAC_IGNORED_OPS` (public in torch.utils.checkpoint) is torch's own list of such ops."""
    from torch.utils import checkpoint as ckpt

    profiler = torch.ops.profiler
    for op in (profiler._record_function_enter.default, profiler._record_function_enter_new.default,
               profiler._record_function_exit._RecordFunction):
        ckpt.SAC_IGNORED_OPS.add(op)


def _selective_context() -> Any:
    _ignore_profiler_ranges()
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
                # a MoE block's gathered FFN is its shared experts (tensor.py); a MoE without them has none
                ffn = getattr(block.feed_forward, "shared", block.feed_forward)
                for gathered in (block.attention, ffn):
                    if gathered is not None:
                        setattr(gathered, CHECKPOINTED_ATTR, mode != "none")
                if mode == "selective" and not getattr(block, "_hpctrain_row_hooks", False):
                    for proj in (block.attention.wo, getattr(ffn, "w2", None)):
                        if isinstance(proj, nn.Linear) and isinstance(proj.weight, DTensor):  # TP applied
                            proj.register_forward_pre_hook(_enter_row_parallel)
                            proj.register_forward_hook(_leave_row_parallel, always_call=True)
                    # setattr: a plain flag, and nn.Module's typed __setattr__ takes only tensors and modules
                    setattr(block, "_hpctrain_row_hooks", True)
                block.ac_context_fn = _selective_context if mode == "selective" else None
