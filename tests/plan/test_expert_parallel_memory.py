"""The planner's memory and parameter counts under expert parallelism (issue 24 item 6): routed experts divided
by ep and FSDP-sharded over efsdp = dp*tp/ep, router replicated, shared experts by tp, dispatched-token
activations scaled by the load of the rank's experts; the search's ep layout rule. MemTracker agreement is
tests/plan/test_memory_truth.py's (bench/memory_accuracy.py's ep rows)."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.config.model import PRESETS
from hpctrain.plan import resolve_job
from hpctrain.plan.activations import expert_routing, layer_activations
from hpctrain.plan.memory import rank_memory
from hpctrain.plan.model_stats import (
    attention_params,
    dense_ffn_params,
    param_count,
    routed_expert_params,
    stage_param_count,
    stage_routed_expert_params,
)
from hpctrain.plan.rank_setup import RankSetup
from hpctrain.plan.space import ep_layout_problem
from hpctrain.plan.stages import balanced_stage_split

# 8 experts of width 96 (top-2), a shared expert of width 64, the first of 4 layers dense.
MOE = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=172, vocab=256, seq_len=128, activation="swiglu",
           moe=dict(experts=8, top_k=2, expert_ffn_hidden=96, shared_experts=1, shared_ffn_hidden=64,
                    dense_layers=1))


def model(**overrides):
    return job_from_dict({"name": "t", "model": {"preset": None, **MOE, **overrides}}).model


def setup(**kw) -> RankSetup:
    base = dict(tp=1, pp=1, dp=8, micro_batch=2, micro_batches=1, schedule="none", virtual_stages=1, ac="none",
                zero=1, offload_optimizer=False, sequence_parallel=False, precision="bf16", optimizer="adamw",
                foreach=False, overhead_bytes=0.0)
    return RankSetup(**{**base, **kw})


def test_a_moe_block_holds_experts_over_ep_whole_a_replicated_router_and_shared_experts_over_tp():
    m = model()
    h, shared = 64, 64
    routed = 8 * 3 * h * 96
    assert routed_expert_params(m) == routed
    attention_and_norms_tp2 = attention_params(m) // 2 + 2 * h
    for tp, ep in ((1, 2), (2, 2), (2, 4), (1, 8)):
        attention_and_norms = attention_params(m) // tp + 2 * h
        want = (attention_and_norms + dense_ffn_params(m) // tp  # layer 0: dense
                + 3 * (attention_and_norms + 8 * h + 3 * h * shared // tp + routed // ep))
        assert stage_param_count(m, 0, 4, has_embedding=False, has_head=False, tp=tp, ep=ep) == want, (tp, ep)
        assert stage_routed_expert_params(m, 0, 4, ep=ep) == 3 * routed // ep
    assert attention_and_norms_tp2 < attention_params(m)
    # ep=1 keeps the count the runtime's param_count_before_dp reports, and the whole model's total
    assert stage_param_count(m, 0, 4, has_embedding=True, has_head=True) == param_count(m)


def test_model_states_shard_experts_over_efsdp_and_the_rest_over_dp():
    m = model()
    split = balanced_stage_split(m, 1, 1)
    full = stage_param_count(m, 0, 4, has_embedding=True, has_head=True, tp=1, ep=4)
    experts = stage_routed_expert_params(m, 0, 4, ep=4)
    for zero in (1, 3):
        s = setup(zero=zero, ep=4)
        assert s.efsdp == 2
        items = dict(rank_memory(m, split, s, 0).items)
        assert items["fp32 master weights"] == pytest.approx(4 * ((full - experts) / 8 + experts / 2))
        assert items["optimizer states"] == pytest.approx(8 * ((full - experts) / 8 + experts / 2))
    # At a fixed dp the experts are spread over the same dp ranks whatever ep is (E/ep experts, each over
    # dp/ep): the sharded states do not change, what a rank gathers to compute (zero 1) shrinks with ep.
    items = [dict(rank_memory(m, split, setup(ep=ep), 0).items) for ep in (1, 2, 4, 8)]
    assert len({round(i["fp32 master weights"], 3) for i in items}) == 1
    gathered = [i["unsharded compute weights (FSDP)"] for i in items]
    assert gathered == sorted(gathered, reverse=True) and len(set(gathered)) == 4
    assert gathered[-1] == pytest.approx(2 * stage_param_count(m, 0, 4, has_embedding=True, has_head=True, ep=8))
    assert setup(ep=8).efsdp == 1 and setup(tp=2, dp=4, ep=4).efsdp == 2  # dp*tp/ep


def test_dispatched_rows_scale_with_the_expert_load():
    m = model()
    tokens = 256
    base = layer_activations(m, tokens, 1, False, "none", "fsdp-mp", expert_routing(1, False, 4, 1.0)).saved_bytes
    skewed = layer_activations(m, tokens, 1, False, "none", "fsdp-mp", expert_routing(1, False, 4, 1.5)).saved_bytes
    # per MoE block and received copy: SwiGLU intermediates (4 x width), the GEMM input (hidden), two int64 indices;
    # averaged over the 4 layers (3 MoE blocks), bf16
    per_copy = 2 * (4 * 96 + 64) + 8 * 2
    assert skewed - base == pytest.approx(0.5 * tokens * 2 * per_copy * 3 / 4)
    # ep=1 has no all-to-all: the load factor does not apply
    one = layer_activations(m, tokens, 1, False, "none", "fsdp-mp", expert_routing(1, False, 1, 1.5)).saved_bytes
    assert one == layer_activations(m, tokens, 1, False, "none", "fsdp-mp").saved_bytes
    # the rank memory follows the factor
    split = balanced_stage_split(m, 1, 1)
    low, high = (rank_memory(m, split, setup(ep=4, expert_load_imbalance=f), 0).activations for f in (1.0, 1.5))
    assert high > low
    # under sequence parallelism each tp rank routes its own sequence shard
    sp = expert_routing(2, True, 4)
    assert sp.token_share == 0.5 and expert_routing(2, False, 4).token_share == 1.0


@pytest.mark.parametrize("ep, dp, tp, sp, ok", [
    (1, 3, 1, False, True), (2, 4, 1, False, True), (4, 2, 1, False, False), (3, 4, 1, False, False),
    (4, 2, 2, True, True),  # ep over dp x tp = 4 ranks, a multiple of tp
    (2, 1, 4, True, False),  # not a multiple of tp
    (4, 2, 2, False, False),  # tp > 1 needs sequence parallelism
    (8, 2, 2, True, False),  # more than dp x tp
])
def test_ep_layout_rule(ep, dp, tp, sp, ok):
    assert (ep_layout_problem(ep, dp, tp, sp) is None) == ok


def test_the_search_passes_ep_to_memory_and_keeps_only_layouts_it_fits():
    base = {"name": "t", "model": {"preset": "qwen3-30b-a3b", "seq_len": 4096}, "train": {"global_batch": 64},
            "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}}
    results = {}
    for ep in (1, 8):
        job = job_from_dict({**base, "parallel": {"ep": ep, "pp": 1, "offload_optimizer": False}})
        _, result = resolve_job(job)
        assert result.layouts and all(lay.dp % ep == 0 and lay.tp == 1 for lay in result.layouts)
        results[ep] = {(lay.dp, lay.micro_batch, lay.ac, lay.zero): lay.memory.weights for lay in result.layouts}
    shared = set(results[1]) & set(results[8])
    assert shared and all(results[8][key] < results[1][key] for key in shared)


def test_qwen3_235b_per_stage_parameters_divide_experts_by_ep():
    """The figures bench/scale_dry_build.py compares with the runtime's (TP2 PP8 EP32 on 256 ranks)."""
    m = job_from_dict({"name": "t", "model": {"preset": None, **PRESETS["qwen3-235b-a22b"]}}).model
    split = balanced_stage_split(m, 8, 1)
    total_tp1_ep1 = sum(stage_param_count(m, a, b, has_embedding=i == 0, has_head=i == 7) for i, (a, b) in enumerate(split))
    assert total_tp1_ep1 == param_count(m)
    routed = sum(stage_routed_expert_params(m, a, b) for a, b in split)
    assert routed == 94 * 128 * 3 * 4096 * 1536
    for i, (a, b) in enumerate(split):
        tp2 = stage_param_count(m, a, b, has_embedding=i == 0, has_head=i == 7, tp=2, ep=32)
        ep1 = stage_param_count(m, a, b, has_embedding=i == 0, has_head=i == 7, tp=2)
        assert ep1 - tp2 == stage_routed_expert_params(m, a, b) // 2 - stage_routed_expert_params(m, a, b, ep=32) \
            - (b - a) * 128 * 4096 // 2  # experts /32 instead of /2, the router replicated instead of /2


def test_a_ranks_mean_layer_matches_its_stage_count():
    """rank_layer_params (the FSDP unit sizes) and stage_param_count agree on the layers' total."""
    from hpctrain.plan.states import rank_layer_params

    m = model(moe=dict(MOE["moe"], dense_layers=0))
    for tp, ep in ((1, 1), (1, 4), (2, 4)):
        stage = stage_param_count(m, 0, 4, has_embedding=False, has_head=False, tp=tp, ep=ep)
        assert 4 * rank_layer_params(m, tp, ep) == pytest.approx(stage, rel=1e-9), (tp, ep)


@pytest.mark.parametrize("ep", [1, 2])
def test_fsdp_keeps_the_last_block_gathered_after_forward_and_the_first_after_backward(ep: int) -> None:
    """ZeRO-3 on one stage: the end of forward keeps the last block (a MoE one) gathered, the end of backward the
    first (dense_layers: a dense one); each at its own size, not the mean layer's (bench/memory_accuracy.py's
    2-layer shared + dense configuration measured the difference against MemTracker: -6.4 % on the weights)."""
    from hpctrain.plan.states import model_counts, rank_layer_params

    m = model(layers=2)
    counts = model_counts(m, 1, ep)
    dense = stage_param_count(m, 0, 1, has_embedding=False, has_head=False, tp=1, ep=ep)
    moe = stage_param_count(m, 1, 2, has_embedding=False, has_head=False, tp=1, ep=ep)
    assert (counts.first_block, counts.last_block) == (dense, moe)
    assert dense < rank_layer_params(m, 1, ep) < moe
    peak = rank_memory(m, [(0, 2)], setup(zero=3, dp=8, ep=ep), 0)
    assert peak.phase.startswith("loss") and dict(peak.items)["unsharded compute weights (FSDP)"] == pytest.approx(
        2 * (moe + counts.head_unit))
    uniform = model_counts(model(layers=2, moe=dict(MOE["moe"], dense_layers=0)), 1, ep)
    assert uniform.first_block == uniform.last_block == uniform.layer_params
