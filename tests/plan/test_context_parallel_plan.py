"""The planner with context parallelism (plan/context.py, issue 25): cp candidates for long sequences,
activations divided by cp plus the K/V buffers, FSDP over dp x cp, and `hpctrain plan` at 128K tokens."""

from __future__ import annotations

from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import PlanError
from hpctrain.plan.context import cp_candidates, cp_kv_extra_bytes, cp_output_join_bytes
from hpctrain.plan.memory import GIB, RankSetup, rank_memory
from hpctrain.plan.planner import plan_job, resolve_job

LLAMA3_405B = dict(preset=None, layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256,
                   rope_theta=500000.0)


def _job(model: dict[str, Any], nodes: int, global_batch: int, **parallel: Any) -> Any:
    return job_from_dict({"name": "long", "model": {**model, "seq_len": 131072},
                          "train": {"global_batch": global_batch, "precision": "bf16"},
                          "parallel": parallel,
                          "cluster": {"executor": "slurm", "nodes": nodes, "gpus_per_node": 8, "gpu": "h100-80gb"}})


@pytest.mark.parametrize("model, nodes, batch", [({"preset": "llama3-8b"}, 1, 8), (LLAMA3_405B, 2048, 128)],
                         ids=["llama3-8b on 8 H100", "llama3-405b on 16384 H100"])
def test_plan_at_128k_tokens_proposes_a_context_parallel_layout_that_fits(model: dict[str, Any], nodes: int,
                                                                          batch: int) -> None:
    result = plan_job(_job(model, nodes, batch))
    best = result.best
    assert best.cp > 1 and best.memory.total <= result.budget_bytes
    assert best.tp * best.pp * best.dp * best.cp == nodes * 8
    assert result.to_json()["layouts"][0]["cp"] == best.cp
    resolved, _ = resolve_job(_job(model, nodes, batch))
    assert resolved.parallel.cp == best.cp and resolved.parallel.dp == best.dp
    print(f"[cp plan] {result.job_name} {nodes * 8} GPUs: {best.label()} {best.memory.total / GIB:.1f} GiB")


def test_without_context_parallelism_nothing_fits_llama3_8b_at_128k() -> None:
    """The same job with cp fixed at 1 (the search's candidates restricted): the planner reports no fit."""
    from hpctrain.plan import space

    job = _job({"preset": "llama3-8b"}, 1, 8)
    original = space.cp_candidates
    space.cp_candidates = lambda job_cp, seq_len, world: (1,)  # type: ignore[assignment]
    try:
        with pytest.raises(PlanError, match="no layout"):
            plan_job(job)
    finally:
        space.cp_candidates = original


def test_cp_candidates() -> None:
    assert cp_candidates(1, 8192, 64) == (1,)  # a short sequence: no CP
    assert cp_candidates(4, 131072, 64) == (4,)  # the job's own degree only
    assert cp_candidates(1, 131072, 24) == (1, 2, 4, 8)  # powers of two dividing the GPUs
    assert cp_candidates(1, 3 * 2**14, 64) == (1, 2, 4, 8, 16, 32, 64)


def _setup(**kw: Any) -> RankSetup:
    base = dict(tp=1, pp=1, dp=1, micro_batch=1, micro_batches=1, schedule="none", virtual_stages=1, ac="none",
                zero=1, offload_optimizer=False, sequence_parallel=False, precision="bf16", optimizer="adamw",
                overhead_bytes=0.0)
    return RankSetup(**{**base, **kw})  # type: ignore[arg-type]


def test_activations_divide_by_cp_plus_the_kv_buffers_and_fsdp_shards_over_dp_x_cp() -> None:
    model = _job({"preset": "llama3-8b"}, 1, 8).model

    def items(**kw: Any) -> dict[str, float]:
        return dict(rank_memory(model, [(0, model.layers)], _setup(**kw), 0).items)

    one, cp2, cp4 = items(dp=2), items(dp=1, cp=2), items(dp=1, cp=4)
    per_layer = model.layers * (cp_kv_extra_bytes(model, 1, 4, 1, 2.0) + cp_output_join_bytes(model, 1, 4, 1, 2.0))
    # the same rank states: FSDP over dp x cp = 2 in both cases
    assert cp2["fp32 master weights"] == one["fp32 master weights"]
    assert cp4["fp32 master weights"] == pytest.approx(one["fp32 master weights"] / 2)
    saved_one = items(dp=1)["saved activations"]
    assert cp4["saved activations"] < cp2["saved activations"] < saved_one
    embedding = 131072 * 8  # the token ids the embedding keeps (int64), per rank's tokens
    assert cp4["saved activations"] - per_layer == pytest.approx((saved_one - embedding) / 4 + embedding / 4, rel=1e-9)
