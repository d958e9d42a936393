"""Activation bytes one transformer layer keeps for backward, against Korthikanti et al. 2022.

    python bench/activation_memory.py          # the table (TP 2/4/8 x SP x AC none/selective x dp 1/2)
                                               # and the context-parallel rows (cp 1/2/4, AC none)

Measured on the runtime's own model (`build_training`, bf16, sequence parallel, no dropout) in one
process over torch's fake process group (torch.testing._internal.distributed.fake_pg: collectives
return buffers of the right shape, so memory is exact while values are not). A dispatch mode
records the storage of every tensor the forward creates; what is still alive when the forward
returns is what the graph keeps for backward (saved tensors, checkpoint caches, kept inputs).
Per layer = the difference between 3 and 1 layers, halved; per sequence = the difference between
micro-batches of 2 and 1 sequences. Both differences cancel what does not scale with layers x
tokens (weights, autocast weight copies, FSDP's unsharded parameters, RoPE tables, the head).

The formula: Korthikanti et al. 2022, Table 2, tensor + sequence parallel: s*b*h*(34/t + 5*a*s/(h*t))
bytes per layer (bf16), and 34*s*b*h/t with selective recomputation. Adapted to this model:
- no dropout: the two masks (1 byte each per element of h: -2) are gone;
- flash attention (scaled_dot_product_attention) keeps no s x s matrix: the 5as/(ht) term is 0;
  it keeps an fp32 log-sum-exp per head and token instead (4 a / t bytes per token);
- RMSNorm (runtime/model/norm.py) keeps its 16-bit input like LayerNorm, plus one fp32 rstd per token;
- attention widths are heads*head_dim for q and the output, and k/v after the GQA repeat;
- SwiGLU: the FFN keeps its input (2h), w1's output, silu's output, w3's output and their product
  (4 x 2f bytes for ffn width f) where GELU with f = 4h keeps 2 x 8h; GELU: 2h + 2 x 2f.
So per token on one TP rank: [2*(2h + 4) + 2h + 2(q + 2kv_rep) + 2q + 4a + 2h + ffn] / t bytes.
Selective recomputation in Korthikanti's sense drops only the attention-score term, which is
already 0 here: the same figure is the reference for both. The runtime's op-level selective
policy recomputes more (norms, activations) and must not exceed it.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = dict(hidden=512, heads=8, kv_heads=8, ffn_hidden=1376, vocab=512, seq_len=256, activation="swiglu")
TOLERANCE = 0.10


def formula_bytes_per_token(model: dict[str, Any], tp: int) -> float:
    """Korthikanti et al. 2022 Table 2 (TP + SP), adapted to this model; see the module docstring."""
    h, a, f = model["hidden"], model["heads"], model["ffn_hidden"]
    d = h // a
    q = a * d
    kv_rep = q if model["kv_heads"] != a else model["kv_heads"] * d
    norms = 2 * (2 * h + 4)
    attention = 2 * h + 2 * (q + 2 * kv_rep) + 2 * q + 4 * a
    ffn = 2 * h + (2 * 4 * f if model["activation"] == "swiglu" else 2 * 2 * f)
    return (norms + attention + ffn) / tp


class _LiveStorages:
    """A dispatch mode remembering (weak reference, bytes) of every storage an op creates."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        seen: dict[Any, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                from torch.distributed.tensor import DTensor
                from torch.utils._pytree import tree_leaves

                import torch

                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        local = t.to_local() if isinstance(t, DTensor) else t
                        storage = local.untyped_storage()
                        seen.setdefault(StorageWeakRef(storage), storage.nbytes())
                return out

        self.mode = Mode()
        self.seen = seen

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.seen.items() if not ref.expired())


def _job(layers: int, tp: int, dp: int, ac: str, batch: int) -> Any:
    from hpctrain.config import job_from_dict

    return job_from_dict({
        "name": "act", "model": {"preset": None, "layers": layers, **MODEL},
        "train": {"global_batch": batch * dp, "micro_batch": batch, "precision": "bf16",
                  "activation_checkpointing": ac, "optimizer": {"name": "adamw"}},
        "parallel": {"tp": tp, "pp": 1, "dp": dp, "zero": 2, "sequence_parallel": True},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": tp * dp},
    })


def _forward_live_bytes(layers: int, tp: int, dp: int, ac: str, batch: int) -> int:
    """Bytes alive after one forward (kept for backward plus the output) on rank 0."""
    import torch

    from hpctrain.runtime.parallel.build import build_training

    training = build_training(_job(layers, tp, dp, ac, batch), torch.device("cpu"))
    tokens = torch.randint(0, MODEL["vocab"], (batch, MODEL["seq_len"]))
    tracker = _LiveStorages()
    with training._contexts(), tracker.mode:
        out = training.model_parts[0](tokens)
        live = tracker.live_bytes()
    del out
    return live


def _with_fake_group(world: int, fn: Any) -> Any:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def measure_bytes_per_token(tp: int, dp: int, ac: str) -> float:
    """Bytes one layer keeps per token on one TP rank (see the module docstring)."""
    def run() -> float:
        live = {(n, b): _forward_live_bytes(n, tp, dp, ac, b) for n in (1, 3) for b in (1, 2)}
        per_layer_sequence = (live[3, 2] - live[1, 2] - live[3, 1] + live[1, 1]) / 2
        return per_layer_sequence / MODEL["seq_len"]

    return _with_fake_group(tp * dp, run)


# ----------------------------------------------------------------------------- context parallelism
# Per layer and sequence on a cp rank (runtime/parallel/context.py): every per-token tensor for
# seq_len / cp tokens, plus the stated K/V buffers (plan/context.py): the other ranks' K and V
# (cp_kv_extra_bytes) and the joined output of the rank's two chunks (cp_output_join_bytes). The CPU's
# materialised causal masks have no batch dimension: the per-sequence difference cancels them.
CP_TOLERANCE = 0.05


def _cp_job(layers: int, cp: int, batch: int) -> Any:
    from hpctrain.config import job_from_dict

    return job_from_dict({
        "name": "act-cp", "model": {"preset": None, "layers": layers, **MODEL},
        "train": {"global_batch": batch, "micro_batch": batch, "precision": "bf16",
                  "activation_checkpointing": "none", "optimizer": {"name": "adamw"}},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "cp": cp, "zero": 2},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": cp},
    })


def _cp_forward_live_bytes(layers: int, cp: int, batch: int) -> int:
    import torch

    from hpctrain.runtime.parallel.build import build_training

    training = build_training(_cp_job(layers, cp, batch), torch.device("cpu"))
    tokens = training.local_tokens(torch.randint(0, MODEL["vocab"], (batch, MODEL["seq_len"])))
    tracker = _LiveStorages()
    with training._contexts(), tracker.mode:
        out = training.model_parts[0](tokens)
        live = tracker.live_bytes()
    del out
    return live


def measure_cp_bytes_per_sequence(cp: int) -> float:
    """Bytes one layer keeps per sequence on context-parallel rank 0 (bf16, no checkpointing)."""
    def run() -> float:
        live = {(n, b): _cp_forward_live_bytes(n, cp, b) for n in (1, 3) for b in (1, 2)}
        return (live[3, 2] - live[1, 2] - live[3, 1] + live[1, 1]) / 2

    return float(run()) if cp == 1 else _with_fake_group(cp, run)


def cp_stated_buffers(cp: int) -> float:
    """The K/V buffers the planner states per layer and sequence (plan/context.py), bf16."""
    from types import SimpleNamespace

    from hpctrain.plan.context import cp_kv_extra_bytes, cp_output_join_bytes

    model = SimpleNamespace(**MODEL, head_dim=0)
    return cp_kv_extra_bytes(model, 1, cp, 1, 2.0) + cp_output_join_bytes(model, 1, cp, 1, 2.0)


def cp_table(cps: tuple[int, ...] = (2, 4)) -> list[dict[str, Any]]:
    """Measured per layer and sequence at each cp against the no-CP figure / cp plus the stated buffers."""
    base = measure_cp_bytes_per_sequence(1)
    rows = [{"cp": 1, "measured": base, "buffers": 0.0, "expected": base, "ratio": 1.0}]
    for cp in cps:
        measured = measure_cp_bytes_per_sequence(cp)
        buffers = cp_stated_buffers(cp)
        expected = base / cp + buffers
        rows.append({"cp": cp, "measured": measured, "buffers": buffers, "expected": expected,
                     "ratio": (measured - buffers) / (base / cp)})
    return rows


def table(cases: list[tuple[int, int, str]]) -> list[dict[str, Any]]:
    rows = []
    for tp, dp, ac in cases:
        measured = measure_bytes_per_token(tp, dp, ac)
        formula = formula_bytes_per_token(MODEL, tp)
        rows.append({"tp": tp, "dp": dp, "ac": ac, "measured": measured, "formula": formula,
                     "ratio": measured / formula})
    return rows


def main() -> int:
    import torch

    torch.set_num_threads(1)
    cases = [(t, d, ac) for t in (2, 4, 8) for ac in ("none", "selective") for d in (1, 2)]
    rows = table(cases)
    h = MODEL["hidden"]
    print(f"model {MODEL}, bf16, sequence parallel, per layer per token on one TP rank")
    print(f"{'tp':>3} {'dp':>3} {'ac':>10} {'measured B':>11} {'formula B':>10} {'meas/sbh':>9} "
          f"{'formula/sbh':>12} {'ratio':>6}")
    bad = 0
    for r in rows:
        ok = r["ratio"] <= 1 + TOLERANCE and (r["ac"] != "none" or r["ratio"] >= 1 - TOLERANCE)
        bad += not ok
        print(f"{r['tp']:>3} {r['dp']:>3} {r['ac']:>10} {r['measured']:>11.1f} {r['formula']:>10.1f} "
              f"{r['measured'] / h:>9.2f} {r['formula'] / h:>12.2f} {r['ratio']:>6.3f}{'' if ok else '  OFF'}")
    print(f"\ncontext parallelism: per layer per sequence of {MODEL['seq_len']} tokens on cp rank 0 (bf16, ac none, tp 1)")
    print(f"{'cp':>3} {'measured B':>11} {'K/V buffers B':>14} {'no-CP/cp + buffers B':>21} {'(meas-buf)/(no-CP/cp)':>22}")
    for r in cp_table():
        ok = abs(r["ratio"] - 1) <= CP_TOLERANCE
        bad += not ok
        print(f"{r['cp']:>3} {r['measured']:>11.0f} {r['buffers']:>14.0f} {r['expected']:>21.0f} "
              f"{r['ratio']:>22.3f}{'' if ok else '  OFF'}")
    return 1 if bad else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
