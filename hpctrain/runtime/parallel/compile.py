"""`train.compile: true`: each transformer block compiled with torch.compile (inductor).

Per block, as torchtitan does (`apply_compile` in torchtitan/models/llama3/infra/parallelize.py:
"Apply torch.compile to each TransformerBlock, which makes compilation efficient due to repeated
structure"): every block has the same code and shapes, so one compiled graph serves all of them,
and compile time does not grow with depth. The embedding, final norm and head stay eager.

Order (torchtitan's): tensor parallel -> activation checkpointing -> compile -> FSDP2. Compiling
after TP traces the DTensor collectives into the graph; after AC, the checkpointed region (full or
the selective policy) is captured by the compiler; before FSDP, so FSDP2's per-block hooks stay
outside the compiled region (dynamo skips FSDP hooks).

The block is compiled in place (`nn.Module.compile`, torch >= 2.2) rather than wrapped in an
`OptimizedModule` as torchtitan does: a wrapper would insert `_orig_mod` into every parameter
name, and names are what the seeded initialisation and the checkpoints key on (a checkpoint saved
with compile loads without it, and the reverse). `fullgraph=True` (torchtitan's default for dense
blocks): a graph break is an error at the first step, never a silent slowdown.

Layouts: data parallel (FSDP2, every zero stage), pipelining (each stage's blocks, every
schedule) and activation checkpointing compile; the losses match eager within 1e-4
(tests/runtime/test_compile.py). Tensor parallel does not yet, and is refused with one line
(`hpctrain validate` for a fixed tp > 1; the planner turns compile off, with a note, when it
chooses tp > 1 itself; build_training for a hand-edited resolved job). Measured on torch 2.13:
a TP block fails in backward inside DTensor's redistribute (a plain tensor where a DTensor
gradient is expected), and sequence parallel's re-gather hook reads a storage pointer that
dynamo cannot trace. The first step pays the compilation (~20 s for the first block shape on
one CPU core; inductor's on-disk cache, TORCHINDUCTOR_CACHE_DIR, serves later starts and requeues).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from hpctrain.runtime.model.transformer import TransformerBlock


def apply_compile(modules: nn.Module | Iterable[nn.Module]) -> int:
    """Compile every TransformerBlock in `modules` in place; returns how many were compiled."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    blocks = [block for root in roots for block in root.modules() if isinstance(block, TransformerBlock)]
    for block in blocks:
        block.compile(fullgraph=True)
    return len(blocks)
