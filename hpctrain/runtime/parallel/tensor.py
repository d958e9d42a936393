"""Tensor parallelism (Megatron-style) with DTensor's `parallelize_module`.

Per block: wq/wk/wv and w1/w3 are column-parallel (each rank holds heads/tp heads and
ffn_hidden/tp columns), wo and w2 are row-parallel; one all-reduce after attention and one after
the MLP. The embedding is row-parallel over the vocabulary (its backward computes only the
rank's rows: vocab.py), the head column-parallel over it.

Sequence parallel (`parallel.sequence_parallel`) keeps the residual stream, the norms and the
dropout-free element-wise work sharded along the sequence between blocks: the all-reduces become
reduce-scatter + all-gather pairs and activation memory outside attention/MLP drops by tp. The
gathered inputs of attention and the FFN are not kept for backward: only their sequence shards
are, and backward gathers again (sequence.py; Korthikanti et al. 2022, section 4.2.2).

MoE blocks (model.moe): attention and the shared experts (w1/w3 column-, w2 row-parallel, as the dense
FFN) as above; the router is replicated over tp and the routed experts are left to expert parallelism
(expert.py), whose ep groups span whole tp groups; sequence parallelism is required, and each tp rank routes
its own sequence shard (`_moe_over_tp`).

Loss parallel is always on when tp > 1: the head's logits stay sharded over the vocabulary and the
cross-entropy is computed without gathering them (`torch.distributed.tensor.parallel.loss_parallel`),
saving a [batch, seq, vocab] all-gather. Forward and backward of the loss must run inside
`loss_parallel()`; `Training` (runtime/training.py) does that.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.feed_forward import FeedForward
from hpctrain.runtime.model.moe import MoE
from hpctrain.runtime.model.transformer import Transformer, TransformerBlock
from hpctrain.runtime.parallel.sequence import SequenceShards, gather_sequence_input
from hpctrain.runtime.parallel.vocab import use_vocab_parallel_lookup


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool,
             float8_tensorwise: bool = False) -> None:
    """Shard `model` (a full model or a pipeline stage, still on meta) over `tp_mesh`, in place.

    float8_tensorwise: the block linears that are Float8Linear (train.precision fp8, parallel/float8.py) take
    torchao's float8 styles, the others the plain ones."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if model.tok_embeddings is not None:
        # RowwiseParallel places the weight and reduces the output; the lookup itself is
        # Megatron's, so backward computes only this rank's rows (vocab.py).
        use_vocab_parallel_lookup(model.tok_embeddings)
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # parallelize_module replaced each module's parameter by its own DTensor: re-tie them.
        # Both are Shard(0) over the vocabulary, so the shared shard is right for both uses.
        model.output.weight = model.tok_embeddings.weight

    for module in model.layers.values():
        block = cast(TransformerBlock, module)
        col, row = _styles(block, float8_tensorwise)
        plan: dict[str, Any] = {
            "attention.wq": col("attention.wq")(),
            "attention.wk": col("attention.wk")(),
            "attention.wv": col("attention.wv")(),
            "attention.wo": row("attention.wo")(output_layouts=between_blocks),
        }
        dense = tp_dense_ffn(block)  # the dense FFN, or a MoE block's shared experts (None: it has none)
        if dense is not None:
            prefix = "feed_forward" if dense is block.feed_forward else "feed_forward.shared"
            plan[f"{prefix}.w1"] = col(f"{prefix}.w1")()
            plan[f"{prefix}.w2"] = row(f"{prefix}.w2")(output_layouts=between_blocks)
            if dense.w3 is not None:
                plan[f"{prefix}.w3"] = col(f"{prefix}.w3")()
        if sequence_parallel:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                }
            )
        parallelize_module(block, tp_mesh, plan)
        if sequence_parallel:
            # Instead of PrepareModuleInput(Shard(1) -> Replicate): the same all-gather, but the
            # matmuls keep the sequence shard for backward and gather again there.
            gather_sequence_input(block.attention, tp_mesh)
            if dense is not None:
                gather_sequence_input(dense, tp_mesh)
        if isinstance(block.feed_forward, MoE):
            _moe_over_tp(block.feed_forward, tp_mesh, sequence_parallel)


def tp_dense_ffn(block: TransformerBlock) -> FeedForward | None:
    """The block's tensor-parallel FFN: the dense one, or on a MoE block its shared experts (or None)."""
    ffn = block.feed_forward
    return ffn.shared if isinstance(ffn, MoE) else ffn


def _moe_over_tp(moe: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """A MoE layer under tp (torchtitan's layout with expert tensor parallelism 1): the routed experts are not
    tensor-parallel (expert parallelism spans whole tp groups, expert.py); under sequence parallelism each tp
    rank routes its own sequence shard, so the router's weight is replicated over tp and its gradient is the
    sum of the shards' (Partial, reduced where the gradient takes the parameter's placement: FSDP, or
    Training._match_grad_placements). config/job.py requires sequence parallelism with model.moe and tp > 1."""
    if not sequence_parallel:
        raise ConfigError("parallel.sequence_parallel: got false; must be true with model.moe and parallel.tp > 1 "
                          "(each tp rank routes its own sequence shard); set parallel.sequence_parallel: true")
    gate = moe.router.gate
    gate.weight = nn.Parameter(DTensor.from_local(gate.weight.detach(), tp_mesh, [Replicate()], run_check=False),
                               requires_grad=gate.weight.requires_grad)
    moe.sequence = SequenceShards(tp_mesh)


def _styles(block: TransformerBlock, float8_tensorwise: bool) -> tuple[Any, Any]:
    """(column style for a name, row style for a name): torchao's float8 ones for Float8Linear modules."""
    if not float8_tensorwise:
        return (lambda name: ColwiseParallel), (lambda name: RowwiseParallel)
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    def fp8(name: str) -> bool:
        return isinstance(block.get_submodule(name), Float8Linear)

    return ((lambda name: Float8ColwiseParallel if fp8(name) else ColwiseParallel),
            (lambda name: Float8RowwiseParallel if fp8(name) else RowwiseParallel))
