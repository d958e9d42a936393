"""zero 3 under pipelining gathers each FSDP unit's parameters once per optimizer step, not once
per micro-batch (issue 12 item 4). pp=2 x dp=2 over gloo, 4 micro-batches: the parameter
all-gathers a rank launches in a step equal its FSDP units that hold parameters: its blocks plus
the embedding (first stage) or the final norm + head (last stage), each a unit of its own."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ._dist import run_distributed  # noqa: E402
from ._jobs import dp_slice, global_batch, tiny_job  # noqa: E402


def _count_all_gathers() -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpctrain.runtime.parallel.build import build_training

    job = tiny_job(pp=2, dp=2, zero=3, schedule="1f1b", micro_batch=1, global_batch=8)
    training = build_training(job, torch.device("cpu"))
    # One FSDP state per unit; fully_shard([norm, output]) makes two modules share one.
    states = {id(m._get_fsdp_state()): m._get_fsdp_state() for part in training.model_parts
              for m in part.modules() if isinstance(m, FSDPModule)}
    units = sum(state._fsdp_param_group is not None for state in states.values())
    own_units = {name for part in training.model_parts for name, m in part.named_modules()
                 if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
                 and name in ("tok_embeddings", "norm", "output")}
    counted = {"n": 0}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if str(func).startswith("c10d.") and "allgather" in str(func):
                counted["n"] += 1
            return func(*args, **(kwargs or {}))

    dp, rank = training.dims.dp, training.dp_rank
    for step in range(2):  # count the second step
        inputs, labels = global_batch(step)
        counted["n"] = 0
        with Mode():
            training.train_step(dp_slice(inputs, rank, dp), dp_slice(labels, rank, dp))
    return {"units": units, "all_gathers": counted["n"], "micro_batches": training.n_microbatches,
            "first": training.has_first_stage, "own_units": own_units}


@pytest.mark.dist
def test_zero3_under_pp_gathers_once_per_unit_per_step() -> None:
    for r in run_distributed(_count_all_gathers, 4, timeout_s=240):
        assert r["micro_batches"] == 4
        assert r["all_gathers"] == r["units"], r
        # tiny_job's 4 layers split 2 + 2: two blocks plus the embedding or the norm + head unit.
        assert r["units"] == 3, r
        assert r["own_units"] == ({"tok_embeddings"} if r["first"] else {"norm", "output"}), r
