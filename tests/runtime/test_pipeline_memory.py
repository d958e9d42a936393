"""1F1B memory is bounded by the schedule, not by the micro-batch count (issue 12 item 3).

pp=2 over gloo, the same micro-batch size, 4 and then 32 micro-batches per step: the peak of
live tensor bytes on each rank during a step must stay within 10 %. Before BoundedStage, torch's
PipelineStage kept a receive buffer (activation and gradient) per micro-batch and the last stage
kept every micro-batch's logits, so the peak grew linearly with the micro-batch count.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ._dist import run_distributed  # noqa: E402
from ._jobs import tiny_job  # noqa: E402

SHAPE = dict(hidden=64, heads=4, kv_heads=4, ffn_hidden=128, vocab=512, seq_len=64)


class PeakLiveBytes:
    """Peak of the bytes of storages created under it and still alive (checked after each op)."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        self.live: dict[Any, int] = {}
        self.peak = 0
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        storage = t.untyped_storage()
                        tracker.live.setdefault(StorageWeakRef(storage), storage.nbytes())
                for ref in [r for r in tracker.live if r.expired()]:
                    del tracker.live[ref]
                tracker.peak = max(tracker.peak, sum(tracker.live.values()))
                return out

        self.mode = Mode()


def _peak_of_first_step(micro_batches: int) -> dict[str, Any]:
    from hpctrain.runtime.parallel.build import build_training

    job = tiny_job(pp=2, schedule="1f1b", micro_batch=1, global_batch=micro_batches, **SHAPE)
    training = build_training(job, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab"], (micro_batches, SHAPE["seq_len"] + 1), generator=generator)
    tracker = PeakLiveBytes()
    with tracker.mode:  # the first step: the schedule allocates its buffers inside it
        loss = training.train_step(tokens[:, :-1], tokens[:, 1:])
    return {"peak": tracker.peak, "loss": loss, "pp_rank": training.pp_rank}


def _both(counts: list[int]) -> list[dict[str, Any]]:
    return [_peak_of_first_step(m) for m in counts]


@pytest.mark.dist
def test_1f1b_peak_does_not_grow_with_micro_batches() -> None:
    few, many = 4, 32
    results = run_distributed(_both, 2, [few, many], timeout_s=240)
    for per_rank in results:
        small, large = per_rank
        ratio = large["peak"] / small["peak"]
        print(f"[pp-memory] pp rank {small['pp_rank']}: peak {small['peak'] / 2**20:.2f} MiB with {few} "
              f"micro-batches, {large['peak'] / 2**20:.2f} MiB with {many} ({ratio:.3f}x)")
        assert ratio <= 1.10, f"pp rank {small['pp_rank']}: peak grows {ratio:.2f}x from {few} to {many} micro-batches"
