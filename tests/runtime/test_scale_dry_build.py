"""The scale dry-build machinery at a tiny scale (issue 12 item 11), so bench/scale_dry_build.py
cannot rot silently: two pipeline ranks of a TP2 x PP2 x DP2 job built by the runtime's
`build_training` on a fake process group and fake tensors, each in its own process; their
parameter counts must equal the planner's per-rank count and split the closed-form total, and the
traced step's model states must equal the planner's (activations within 25 %: before the bench
kept DTensor's global-shape propagation temporaries out of MemTracker, they were twice the
planner's here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import scale_dry_build as dry  # noqa: E402

from hpctrain.config.model import PRESETS  # noqa: E402
from hpctrain.plan.model_stats import stage_param_count, stage_routed_expert_params  # noqa: E402


def test_one_f_one_b_order_keeps_pp_minus_rank_in_flight():
    # torch's Schedule1F1B: pp - rank - 1 warm-up forwards, then one forward / one backward.
    assert dry._one_f_one_b(4, 0, 5) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                         ("B", 2), ("B", 3), ("B", 4)]
    assert dry._one_f_one_b(4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for pp, rank in ((4, 0), (4, 2), (16, 5)):
        live, peak = 0, 0
        for kind, _ in dry._one_f_one_b(pp, rank, pp - rank + 1):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == pp - rank


@pytest.mark.timeout(120)
def test_tiny_dry_build_matches_planner_and_closed_form():
    layout = dry.Layout("tiny", dict(PRESETS["tiny"]), tp=2, pp=2, dp=2, micro_batches=2)
    results = dry.dry_build_ranks(layout, (0, 1), trace=True, workers=2)
    model = layout.job().model
    for r in results:
        assert r.params_tp == r.planner_params_tp > 0, r
        # FSDP shards every parameter over dp=2 (dims here are even, so exactly half)
        assert r.params_local * layout.dp == r.params_tp, r
        assert r.maxrss_gib < 2.0, r  # fake tensors: no model memory
        for key in ("PARAM", "OPT"):  # AdamW's step counters are the only extra bytes
            assert r.traced[key] == pytest.approx(r.planner[key], rel=0.01), (key, r)
        assert 0.8 <= r.planner["ACT"] / r.traced["ACT"] <= 1.25, r
        assert 0.85 <= r.planner["Total"] / r.traced["Total"] <= 1.15, r
    # The two stages split the model: their layer ranges tile it and, counted without TP, their
    # parameters add up to the closed-form total.
    ranges = [(r.first_layer, r.last_layer) for r in results]
    assert ranges == [(0, results[1].first_layer), (results[0].last_layer, model.layers)]
    untp = sum(stage_param_count(model, r.first_layer, r.last_layer, has_embedding=r.pp_rank == 0,
                                 has_head=r.pp_rank == 1, tp=1) for r in results)
    assert untp == dry.closed_form_params(layout)
    # The runtime's own counts against the closed form: TP splits every matrix by tp (the tiny
    # shapes divide evenly) and replicates the RMSNorm weights (2 per layer and the final one).
    norms = (2 * model.layers + 1) * model.hidden
    assert sum(r.params_tp for r in results) == (dry.closed_form_params(layout) - norms) // layout.tp + norms


@pytest.mark.timeout(180)
def test_expert_parallel_dry_build_holds_the_planners_experts_per_rank():
    """Issue 24: with parallel.ep a rank holds experts/ep of each MoE block; the runtime's stages (built on a
    fake group of pp2 x dp2, ep2) hold exactly the planner's per-rank count, experts divided by ep.
    (Parameters only: the all-to-all's splits are values fake tensors do not have.)"""
    moe = dict(PRESETS["tiny"], moe=dict(experts=4, top_k=2, expert_ffn_hidden=64, shared_experts=1, dense_layers=1))
    layout = dry.Layout("tiny moe", moe, tp=1, pp=2, dp=2, ep=2, micro_batches=2, sequence_parallel=False)
    results = dry.dry_build_ranks(layout, (0, 1), trace=False, workers=2)
    model = layout.job().model
    for r in results:
        assert r.params_tp == r.planner_params_tp > 0, r
        whole = stage_param_count(model, r.first_layer, r.last_layer, has_embedding=r.pp_rank == 0,
                                  has_head=r.pp_rank == 1)
        routed = stage_routed_expert_params(model, r.first_layer, r.last_layer)
        assert r.params_tp == whole - routed // 2, r  # half of the stage's routed experts


@pytest.mark.timeout(180)
def test_expert_parallel_over_tensor_parallel_dry_build_matches_the_planner():
    """Issue 24, ep over dp x tp (bench/scale_dry_build.py's Qwen3-235B-A22B TP2 PP8 EP32 at a tiny scale): on a
    fake group of tp2 x pp2 x dp2 with ep4, a rank holds the attention and the shared experts over tp, the
    router whole and a quarter of the routed experts whole; the runtime's stages hold the planner's count."""
    moe = dict(PRESETS["tiny"], moe=dict(experts=4, top_k=2, expert_ffn_hidden=64, shared_experts=1, dense_layers=1))
    layout = dry.Layout("tiny moe tp", moe, tp=2, pp=2, dp=2, ep=4, micro_batches=2, sequence_parallel=True)
    results = dry.dry_build_ranks(layout, (0, 1), trace=False, workers=2)
    model = layout.job().model
    for r in results:
        assert r.params_tp == r.planner_params_tp > 0, r
        routed = stage_routed_expert_params(model, r.first_layer, r.last_layer)
        at_ep1 = stage_param_count(model, r.first_layer, r.last_layer, has_embedding=r.pp_rank == 0,
                                   has_head=r.pp_rank == 1, tp=2)
        assert r.params_tp != at_ep1 and routed > 0, r  # experts are not split by tp, but by ep
