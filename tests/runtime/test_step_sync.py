"""One host synchronisation per training step (issue 12 item 9).

The trainer's step is `Training.forward_backward` (no host read), the requeue controller's local
flags (host only), `Training.finish_step` (one collective carrying loss, gradient-norm term and
flags, then one device-to-host transfer) and the optimizer step. Counted with a dispatch mode over
real gloo ranks: scalar reads (`aten._local_scalar_dense`: .item(), float(), bool() of a tensor;
on a GPU each is a device synchronisation) and the collectives launched after the backward.
Before, a step made two scalar reads and two blocking all-reduces here, plus the stop agreement.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ._dist import run_distributed  # noqa: E402
from ._jobs import dp_slice, global_batch, tiny_job  # noqa: E402

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast")
LAYOUTS = [dict(dp=2, zero=2, micro_batch=2), dict(pp=2, schedule="1f1b", micro_batch=2)]


class OpCounter:
    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.scalar_reads = 0
        self.collectives = 0
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = str(func)
                if "_local_scalar_dense" in name:
                    counter.scalar_reads += 1
                if name.startswith("c10d.") and any(c in name for c in COLLECTIVES):
                    counter.collectives += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _count(kwargs: dict[str, Any]) -> dict[str, Any]:
    from hpctrain.runtime.parallel.build import build_training

    job = tiny_job(**kwargs)
    training = build_training(job, torch.device("cpu"))
    optimizer = torch.optim.SGD(training.parameters(), lr=0.1)
    dp, rank = training.dims.dp, training.dp_rank
    out: dict[str, Any] = {}
    for step in range(2):  # the second step: nothing left to set up
        inputs, labels = global_batch(step)
        fwd_bwd, end = OpCounter(), OpCounter()
        optimizer.zero_grad()
        with fwd_bwd.mode:
            local = training.forward_backward(dp_slice(inputs, rank, dp), dp_slice(labels, rank, dp))
        expected = training._global_mean(local.clone())  # the old reduction (in place), not counted
        with end.mode:
            loss, norm, flags = training.finish_step(local, 0.5, [torch.distributed.get_rank() == 1, 0])
            training.optimizer_step(optimizer)
        out = {"reads": fwd_bwd.scalar_reads + end.scalar_reads, "end_collectives": end.collectives,
               "loss": loss, "norm": norm, "flags": flags, "expected_loss": expected}
    return out


def _all(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_count(kwargs) for kwargs in layouts]


@pytest.mark.dist
def test_one_collective_and_no_scalar_read_per_step() -> None:
    results = run_distributed(_all, 2, LAYOUTS, timeout_s=240)
    for i, layout in enumerate(LAYOUTS):
        ranks = [per_rank[i] for per_rank in results]
        for r in ranks:
            assert r["reads"] == 0, f"{layout}: {r['reads']} scalar reads in a step"
            assert r["end_collectives"] == 1, f"{layout}: {r['end_collectives']} collectives after the backward"
            assert r["flags"] == [1, 0], f"{layout}: flags agreed as {r['flags']} (rank 1 raised the first)"
        # Every rank knows the same loss and norm, and the loss is the one train_step reports.
        assert len({r["loss"] for r in ranks}) == 1 and len({r["norm"] for r in ranks}) == 1
        assert abs(ranks[0]["loss"] - ranks[0]["expected_loss"]) < 1e-6
