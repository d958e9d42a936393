"""The search's memory memo (plan/memory.py `cache`) gives every candidate exactly the breakdown that a
fresh evaluation gives: a cache key that missed a field the terms read would fail here. The rank totals it sets
layouts over the budget aside with and picks the peak rank by (`MemoryProbe.rank_total`, no breakdown) equal the
breakdowns' totals, and setting layouts aside changes nothing the search reports."""

from __future__ import annotations

import pytest

import hpctrain.plan.search as search_module
from hpctrain.config import job_from_dict
from hpctrain.plan import plan_job
from hpctrain.plan.memory import MemoryProbe, peak_rank_memory, rank_memory
from hpctrain.plan.space import Rejections

FREE = {"tp": "auto", "pp": "auto", "dp": "auto", "schedule": "auto", "virtual_stages": "auto", "zero": "auto",
        "sequence_parallel": True}
JOBS = {
    "dense pp interleaved": {"model": {"preset": "llama3-70b"}, "train": {"global_batch": 128},
                             "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100",
                                         "fabric": "ib-ndr400"}},
    "moe ep": {"model": {"preset": "mixtral-8x7b"}, "train": {"global_batch": 64},
               "parallel": {**FREE, "ep": "auto"},
               "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100",
                           "fabric": "ib-ndr400"}},
    "long context cp": {"model": {"preset": "llama3-8b", "seq_len": 131072}, "train": {"global_batch": 8},
                        "parallel": {**FREE, "cp": 4},
                        "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100",
                                    "fabric": "ib-ndr400"}},
    "moe long context": {"model": {"preset": "qwen3-30b-a3b", "seq_len": 32768}, "train": {"global_batch": 64},
                         "parallel": {**FREE, "ep": "auto"},
                         "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100",
                                     "fabric": "ib-ndr400"}},
    "lora fp32": {"model": {"preset": "llama3-8b"}, "train": {"global_batch": 32, "precision": "fp32",
                                                               "lora": {"rank": 16}},
                  "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "a100-80gb", "node": "dgx-a100",
                              "fabric": "ib-hdr200"}},
}


def _spec(name: str) -> dict:
    spec = {"name": "memo", "parallel": FREE, **JOBS[name]}
    spec["train"] = {"micro_batch": "auto", "activation_checkpointing": "auto", **spec["train"]}
    return spec


@pytest.mark.parametrize("name", sorted(JOBS))
def test_memoised_memory_equals_a_fresh_evaluation(name, monkeypatch):
    calls = []

    everything: dict = {}

    class Checked(MemoryProbe):
        def __init__(self, model, stage_layers, setup, cache, act=None):
            super().__init__(model, stage_layers, setup, cache, act)
            if act is not None:  # the search's shared terms are the setup's own
                assert act == MemoryProbe(model, stage_layers, setup, {}).act, setup
            everything[setup] = (model, stage_layers, setup, {})

        def rank_total(self, rank: int) -> float:
            total = super().rank_total(rank)
            fresh = rank_memory(self.model, self.stage_layers, self.setup, rank).total
            assert abs(total / fresh - 1) < 1e-12, (rank, self.setup)  # every phase, term for term
            return total

        def peak(self):
            memoised = super().peak()
            assert memoised == peak_rank_memory(self.model, self.stage_layers, self.setup), self.setup
            calls.append(self.setup)
            return memoised

    monkeypatch.setattr(search_module, "MemoryProbe", Checked)
    result = plan_job(job_from_dict(_spec(name)))
    # the first micro-batches' loss never falls as the micro-batch grows, the rest of the layout fixed: the search
    # sets the larger micro-batches aside on it
    by_layout: dict = {}
    for setup in everything:
        rest = tuple(getattr(setup, f) for f in ("tp", "pp", "dp", "cp", "ep", "schedule", "virtual_stages", "ac",
                                                 "zero", "offload_optimizer"))
        by_layout.setdefault(rest, []).append((setup.micro_batch, MemoryProbe(*everything[setup]).first_loss_floor()))
    grown = 0
    for floors in by_layout.values():
        floors.sort()
        for (_, smaller), (_, larger) in zip(floors, floors[1:]):
            assert larger >= smaller * (1 - 1e-12)
            grown += larger > smaller
    assert grown > 0
    assert result.evaluated > 20
    assert len(calls) <= result.evaluated
    assert result.layouts


def _report(result) -> tuple:
    rejected = result.rejected
    return ([(lay.label(), lay.memory, lay.cost) for lay in result.layouts], rejected.counts, rejected.examples,
            rejected.family_reasons, result.evaluated)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_setting_layouts_over_the_budget_aside_changes_nothing_reported(name, monkeypatch):
    settled = []
    over = MemoryProbe.over

    def counted(self, budget, bar):
        settled.append(over(self, budget, bar))
        return settled[-1]

    monkeypatch.setattr(MemoryProbe, "over", counted)
    with_floor = plan_job(job_from_dict(_spec(name)))
    if name == "moe long context":  # most of its misses are set aside, on their floors or at a larger micro-batch
        misses = with_floor.rejected.counts["memory_over_budget"]
        assert sum(settled) > misses / 4 and len(settled) < with_floor.evaluated - misses / 4
    monkeypatch.setattr(Rejections, "memory_miss_bar", lambda self, family: None)
    without = plan_job(job_from_dict(_spec(name)))
    assert _report(with_floor) == _report(without)
    assert with_floor.rejected.counts.get("memory_over_budget", 0) > 0 or name == "lora fp32"


@pytest.mark.parametrize("name", sorted(JOBS))
def test_setting_full_recomputation_beside_a_fitting_selective_twin_aside_changes_nothing_reported(name, monkeypatch):
    """The search leaves such layouts without a breakdown or a cost (search.SetAside): prefer_selective drops them
    all the same, with the same rejection examples in the same order."""
    set_aside = []

    class Counted(search_module.SetAside):
        def __init__(self, label, family):
            set_aside.append(label)
            super().__init__(label, family)

    monkeypatch.setattr(search_module, "SetAside", Counted)
    quick = plan_job(job_from_dict(_spec(name)))
    monkeypatch.setattr(MemoryProbe, "peak_total", lambda self: float("inf"))  # never known to fit: all costed
    slow = plan_job(job_from_dict(_spec(name)))
    assert _report(quick) == _report(slow)
    if name != "lora fp32":  # fp32 LoRA: no layout needs recomputation there
        assert set_aside and quick.rejected.counts["selective_recompute_fits"] >= len(set_aside)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_layouts_ranked_by_rank_totals_come_in_the_breakdowns_order(name, monkeypatch):
    """search.ranked orders by the rank totals and builds breakdowns only where neighbours tie within rounding: the
    same order as a stable sort by the breakdowns' totals (the search's order among equals)."""
    seen = []
    original = search_module.ranked

    def kept(layouts):
        seen.append(list(layouts))
        return original(layouts)

    monkeypatch.setattr(search_module, "ranked", kept)
    result = plan_job(job_from_dict(_spec(name)))
    exact = sorted(seen[0], key=lambda lay: (-lay.cost.tokens_per_s, search_module.AC_ORDER[lay.ac], lay.memory.total))
    assert [id(lay) for lay in result.layouts] == [id(lay) for lay in exact]
    assert len(result.layouts) > 3


def test_totals_within_rounding_are_ordered_by_their_breakdowns():
    """Where two rank totals lie within rounding of each other (none in the searches above), the breakdowns' totals
    order them, and equal ones keep the search's order."""
    from dataclasses import replace

    from hpctrain.plan.rank_setup import MemoryBreakdown

    class Totals:  # a probe of given totals: the rank totals and the breakdowns' may differ in the last bits
        def __init__(self, rank_total, breakdown_total):
            self.rank_total, self.breakdown = rank_total, MemoryBreakdown(breakdown_total, 0, 0, 0, 0, "loss")

        def peak_total(self):
            return self.rank_total

        def peak(self):
            return 0, self.breakdown

    base = plan_job(job_from_dict(_spec("dense pp interleaved"))).layouts[0]
    gib = 2.0**30
    probes = [Totals(10 * gib, 10 * gib + 2.0), Totals(10 * gib + 1.0, 10 * gib + 1.0), Totals(9 * gib, 9 * gib),
              Totals(10 * gib, 10 * gib + 1.0), Totals(11 * gib, 11 * gib)]
    layouts = [replace(base, probe=probe) for probe in probes]
    order = [next(i for i, known in enumerate(layouts) if known is lay) for lay in search_module.ranked(layouts)]
    assert order == [2, 1, 3, 0, 4]  # by the rank totals alone: 2, 0, 3, 1, 4


@pytest.mark.parametrize("name", ["moe long context", "dense pp interleaved"])
def test_candidates_setups_are_whole_dataclasses_of_their_layout(name, monkeypatch):
    """The search builds each candidate's RankSetup and CostSetup from a per-family template (search._variant, no
    __init__): every field set, none added (a misspelt change would add an attribute and leave the field at the
    template's value), equal to the dataclass built anew, and the fields the loops vary those of the candidate."""
    from dataclasses import fields, replace

    from hpctrain.plan.cost_setup import CostSetup

    costed = []
    original = search_module.step_cost

    def recorded(model, hw, setup, global_batch, memo):
        costed.append(setup)
        return original(model, hw, setup, global_batch, memo)

    monkeypatch.setattr(search_module, "step_cost", recorded)
    result = plan_job(job_from_dict(_spec(name)))
    layouts = result.layouts
    assert len(costed) >= len(layouts) > 3
    for setup in costed:
        assert set(vars(setup)) == {f.name for f in fields(CostSetup)}
        assert replace(setup) == setup
    for lay in layouts:
        setup = lay.probe.setup
        assert set(vars(setup)) == {f.name for f in fields(type(setup))}
        assert replace(setup) == setup
        assert (setup.micro_batch, setup.schedule, setup.virtual_stages, setup.ac, setup.zero,
                setup.offload_optimizer, setup.tp, setup.pp, setup.dp, setup.cp, setup.ep) == \
            (lay.micro_batch, lay.schedule, lay.virtual_stages, lay.ac, lay.zero, lay.offload_optimizer, lay.tp,
             lay.pp, lay.dp, lay.cp, lay.ep)
        assert setup.micro_batches == _spec(name)["train"]["global_batch"] // lay.dp // lay.micro_batch
    # each layout was priced on its own micro-batch, recomputation and sharding
    priced = {(s.tp, s.pp, s.dp // s.cp, s.cp, s.ep, s.micro_batch, s.virtual_stages, s.ac, s.zero, s.offload_optimizer)
              for s in costed}
    assert {(lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.micro_batch, lay.virtual_stages, lay.ac, lay.zero,
             lay.offload_optimizer) for lay in layouts} <= priced


def test_search_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """The search runs with Python's cyclic collector off (search._collector_paused) and leaves it as it found it,
    on or off, also when the search raises."""
    import gc

    seen = []
    original = search_module.search_part

    def watched(*args):
        seen.append(gc.isenabled())
        return original(*args)

    job = job_from_dict(_spec("lora fp32"))
    monkeypatch.setattr(search_module, "search_part", watched)
    try:
        assert gc.isenabled()
        plan_job(job)
        assert gc.isenabled()
        gc.disable()
        plan_job(job)
        assert not gc.isenabled()
        gc.enable()
        monkeypatch.setattr(search_module, "search_part", lambda *args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            plan_job(job)
        assert gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, False]
