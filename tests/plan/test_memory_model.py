"""Memory model: structural checks (the figures against MemTracker are in test_memory_truth.py)."""

from __future__ import annotations

from typing import Any

import pytest

from hpctrain.plan.activations import in_flight_micro_batches
from hpctrain.plan.memory import peak_rank_memory
from hpctrain.plan.rank_setup import GIB, RankSetup
from hpctrain.plan.stages import balanced_stage_split

from .shapes import LLAMA3_8B


def setup(**kw) -> RankSetup:
    base: dict[str, Any] = dict(tp=1, pp=1, dp=1, micro_batch=1, micro_batches=1, schedule="none", virtual_stages=1, ac="none",
                zero=0, offload_optimizer=False, sequence_parallel=False, precision="bf16", optimizer="adamw",
                overhead_bytes=0.0)
    base.update(kw)
    return RankSetup(**base)


def total(model, **kw) -> float:
    s = setup(**kw)
    return peak_rank_memory(model, balanced_stage_split(model, s.pp, s.virtual_stages), s)[1].total


def test_each_knob_lowers_memory():
    m = LLAMA3_8B
    base = total(m, dp=8, zero=1, micro_batch=2)
    assert total(m, dp=8, zero=3, micro_batch=2) < base
    assert total(m, dp=8, zero=1, micro_batch=1, micro_batches=2) < base
    assert total(m, dp=8, zero=1, micro_batch=2, ac="selective") < base
    assert total(m, dp=8, zero=1, micro_batch=2, ac="full") < total(m, dp=8, zero=1, micro_batch=2, ac="selective")
    assert total(m, tp=2, dp=4, zero=1, micro_batch=2) < base
    assert total(m, tp=2, dp=4, zero=1, micro_batch=2, sequence_parallel=True) < total(m, tp=2, dp=4, zero=1,
                                                                                        micro_batch=2)
    assert total(m, dp=8, zero=1, micro_batch=2, offload_optimizer=True) < base


def test_breakdown_is_never_just_a_total():
    s = setup(dp=8, zero=1, micro_batch=2, overhead_bytes=GIB)
    rank, mem = peak_rank_memory(LLAMA3_8B, [(0, 32)], s)
    assert mem.total == pytest.approx(sum(value for _, value in mem.items))
    assert set(mem.gib()) == {"weights", "grads", "optimizer", "activations", "other", "total"}
    assert dict(mem.items)["runtime overhead (CUDA context, allocator)"] == GIB


@pytest.mark.parametrize(
    "schedule, pp, rank, m, v, expected",
    [("gpipe", 4, 0, 8, 1, 8), ("1f1b", 4, 0, 8, 1, 4), ("1f1b", 4, 3, 8, 1, 1), ("1f1b", 4, 0, 2, 1, 2),
     ("interleaved-1f1b", 4, 0, 8, 2, (4 + 6 + 1) / 2), ("interleaved-1f1b", 4, 3, 8, 2, (4 + 0 + 1) / 2)],
)
def test_in_flight_micro_batches(schedule, pp, rank, m, v, expected):
    assert in_flight_micro_batches(schedule, pp, rank, m, v) == pytest.approx(expected)


def test_first_pipeline_stage_is_most_loaded_under_1f1b():
    m = LLAMA3_8B
    s = setup(pp=4, dp=2, zero=1, micro_batches=8, schedule="1f1b", micro_batch=1)
    rank, _ = peak_rank_memory(m, balanced_stage_split(m, 4, 1), s)
    assert rank == 0
