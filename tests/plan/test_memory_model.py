"""Memory model: published sanity figures (ZeRO paper, DeepSpeed's estimator) and structural checks."""

from __future__ import annotations

from typing import Any

import pytest

from hpctrain.plan.activations import in_flight_micro_batches
from hpctrain.plan.memory import GIB, RankSetup, deepspeed_zero3_gpu_bytes, model_states_bytes, peak_rank_memory
from hpctrain.plan.stages import balanced_stage_split

from .shapes import LLAMA3_8B


@pytest.mark.parametrize("zero, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(zero, gb):
    # Rajbhandari et al. 2019, figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12).
    assert model_states_bytes(7.5e9, 64, zero) / 1e9 == pytest.approx(gb, rel=0.02)


T0_3B_PARAMS = 2783e6  # "2783M total params"
T0_3B_LARGEST = 32128 * 2048  # the shared embedding, "65M largest layer params"


@pytest.mark.parametrize(
    "gpus, offload_optimizer, offload_params, gib",
    [(1, False, False, 46.91), (1, True, False, 5.43), (1, True, True, 0.25), (2, False, False, 23.58),
     (2, True, False, 2.84)],
)
def test_deepspeed_zero3_estimator(gpus, offload_optimizer, offload_params, gib):
    # DeepSpeed docs, "Memory Requirements": estimate_zero3_model_states_mem_needs_all_cold output.
    value = deepspeed_zero3_gpu_bytes(T0_3B_PARAMS, T0_3B_LARGEST, gpus, offload_optimizer=offload_optimizer,
                                      offload_params=offload_params) / GIB
    assert value == pytest.approx(gib, rel=0.02)


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
