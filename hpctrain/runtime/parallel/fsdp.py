"""Data parallelism with FSDP2 (`fully_shard`) over the "dp" mesh dimension.

DDP is not used: measured on torch 2.13 it does not combine with tensor parallelism (error) nor
with pipelining (internal assert), and the DDP-based composable `replicate` gives silently wrong
losses with TP. FSDP2 combines with both, so every ZeRO stage maps onto it:

| zero | reshard_after_forward | gradient reduce-scatter           | what is sharded at rest        |
|------|-----------------------|-----------------------------------|--------------------------------|
| 0    | False                 | once per step (last micro-batch)  | params, grads, optimizer state |
| 1    | False                 | once per step (last micro-batch)  | params, grads, optimizer state |
| 2    | False                 | every micro-batch                 | params, grads, optimizer state |
| 3    | True                  | every micro-batch                 | + params between fwd and bwd   |

zero 0 with dp > 1 therefore behaves like zero 1 (never more memory than DDP's full replica: FSDP2
reshards after backward). Under pipelining the schedule itself defers the reduce-scatter to the
last micro-batch (`backward_maybe_with_nosync`), so zero 1 and 2 coincide there; it also keeps
parameters unsharded from one micro-batch's backward to the next, and `apply_fsdp(pipelined=True)`
does not reshard after forward: under pipelining zero 3 gathers each unit's parameters once per
step, not once per micro-batch in forward and again in backward (torchtitan does the same), and
holds them unsharded for the step (the memory of zero 1/2's parameters, with zero 3's sharded
gradients and optimizer state).

FSDP units (what one all-gather and one reduce-scatter move), per model part (pipeline stage):

| unit                        | holds                       | reshard after forward (zero 3, no PP) |
|-----------------------------|-----------------------------|---------------------------------------|
| `tok_embeddings`            | the embedding (first stage) | yes                                   |
| each `TransformerBlock`     | one layer                   | yes, but for the last block           |
| `[norm, output]`            | final norm + head (last)    | no: its backward comes right after    |
| the part itself (root)      | nothing; the tied embedding | no (FSDP2 never reshards the root)    |
|                             | + norm + head when tied     |                                       |

The embedding and the norm + head are units of their own, as in torchtitan's `apply_fsdp`
(torchtitan/models/llama3/infra/parallelize.py), instead of the root's: under zero 3 without
pipelining the embedding is freed after its forward, the head is gathered only when needed, and
neither is gathered before layer 0 (for Llama-3 that is about 1B parameters). A model whose head
shares the embedding's weight on one part keeps both in the root: one parameter, one unit.
Under pipelining nothing reshards after forward, so zero 3 all-gathers each unit once per step
(tests/runtime/test_fsdp_pipeline.py counts them).

Precision: parameters stay fp32 (the master weights the optimizer updates); the mixed-precision
policy casts them to bf16/fp16 for forward and backward and reduces gradients in fp32.
Expert parallelism (`experts_mesh`, runtime/parallel/expert.py): each MoE block's routed experts are a
unit of their own over "efsdp" (dp x cp x tp / ep ranks), their gradients divided by dp x cp (FSDP's dense degree);
the rest of the block as above.

`offload_optimizer` keeps the sharded parameters, gradients and optimizer step on the CPU
(`CPUOffloadPolicy`); it needs FSDP, so it is applied even when dp == 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.transformer import Transformer
from hpctrain.runtime.parallel.expert import shard_experts

if TYPE_CHECKING:
    from hpctrain.config.training import ParallelConfig

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def reshard_after_forward(zero: int) -> bool:
    """The FSDP2 option that realises a ZeRO stage (see the module docstring)."""
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero: got {zero!r}; valid: 0, 1, 2, 3 (resolve 'auto' with `hpctrain plan`)")
    return zero == 3


def zero_stage(parallel: ParallelConfig) -> int:
    """`parallel.zero` of a resolved job ('auto' is the planner's to fill; the runtime's entry checks it)."""
    zero = parallel.zero
    if not isinstance(zero, int):
        raise ConfigError(f"parallel.zero: got {zero!r}; valid: 0, 1, 2, 3 (resolve 'auto' with `hpctrain plan`)")
    return zero


def sync_every_microbatch(zero: int) -> bool:
    """Whether gradients are reduce-scattered after every micro-batch (zero 2/3) or once per step."""
    return zero >= 2


def apply_fsdp(
    model_parts: Iterable[Transformer],
    dp_mesh: DeviceMesh,
    *,
    zero: int,
    precision: str,
    offload_optimizer: bool,
    pipelined: bool = False,
    experts_mesh: DeviceMesh | None = None,
    host_embedding: bool = False,
) -> None:
    """Shard each model part over `dp_mesh` as FSDP units (the table in the module docstring).

    host_embedding (train.embedding_on_cpu): the token embedding is no unit and no part of the root's; it
    stays whole on the host (runtime/parallel/host_embedding.py)."""
    if precision not in PARAM_DTYPES:
        raise ConfigError(f"train.precision: got {precision!r}; valid: {', '.join(PARAM_DTYPES)}")
    reshard = reshard_after_forward(zero) and not pipelined
    mp_policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[precision], reduce_dtype=torch.float32)
    # Pinned host memory makes the device<->host copies asynchronous; it needs an accelerator.
    pinned = torch.cuda.is_available()
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=pinned) if offload_optimizer else OffloadPolicy()
    for part in model_parts:
        # A tied embedding and head on one part are one parameter: one unit must own it.
        tied = part.args.tie_embeddings and part.tok_embeddings is not None and part.output is not None
        ignored = set(part.tok_embeddings.parameters()) if host_embedding and part.tok_embeddings is not None else None
        if part.tok_embeddings is not None and not tied and not ignored:
            fully_shard(part.tok_embeddings, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                        offload_policy=offload)
        blocks = list(part.layers.values())
        for i, block in enumerate(blocks):
            if experts_mesh is not None:  # expert parallelism: the routed experts over efsdp, a unit each
                shard_experts(block, experts_mesh, dp_mesh.size(), reshard_after_forward=reshard and i < len(blocks) - 1,
                              mp_policy=mp_policy, offload_policy=offload)
            # The last block's backward starts right after its forward: keeping it unsharded
            # saves one all-gather per step at no memory cost (torchtitan does the same).
            fully_shard(
                block,
                mesh=dp_mesh,
                reshard_after_forward=reshard and i < len(blocks) - 1,
                mp_policy=mp_policy,
                offload_policy=offload,
            )
        if part.norm is not None and part.output is not None and not tied:
            # Last in forward, first in backward: never resharded in between (torchtitan: only
            # with its "always" policy).
            fully_shard([part.norm, part.output], mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy,
                        offload_policy=offload)
        # The root: FSDP2 needs it for its step-level hooks; it owns parameters only when tied.
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload,
                    ignored_params=ignored)
