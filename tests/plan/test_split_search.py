"""A search split over processes (plan/split_search.py) reports exactly what one process does: the layouts in the
same order with the same memory and cost, the rejection counts, the examples in the same order and every family's
reason. Real forked children; a child that dies mid-search leaves its triples to the parent."""

from __future__ import annotations

import json
import os
import sys

import pytest

import hpctrain.plan.split_search as split_module
from hpctrain.config import job_from_dict
from hpctrain.plan import plan_job
from hpctrain.plan.space import Rejections

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the split search forks (Linux only)")

FREE = {"tp": "auto", "pp": "auto", "dp": "auto", "schedule": "auto", "virtual_stages": "auto", "zero": "auto",
        "sequence_parallel": True}
H100 = {"gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}
JOBS = {
    "moe long context": {"model": {"preset": "qwen3-30b-a3b", "seq_len": 32768}, "train": {"global_batch": 64},
                         "parallel": {**FREE, "ep": "auto"}, "cluster": {"nodes": 4, **H100}},
    "dense pp interleaved": {"model": {"preset": "llama3-70b"}, "train": {"global_batch": 128},
                             "parallel": FREE, "cluster": {"nodes": 4, **H100}},
}


def _job(name: str):
    spec = {"name": "split", **JOBS[name]}
    spec["train"] = {"micro_batch": "auto", "activation_checkpointing": "auto", **spec["train"]}
    return job_from_dict(spec)


def _report(result) -> str:
    data = result.to_json(None)
    data.pop("search_time_s")
    rejected = result.rejected
    return json.dumps([data, [(lay.label(), lay.memory, lay.cost, lay.peak_rank) for lay in result.layouts],
                       list(rejected.family_reasons.items()), list(rejected.examples.items())], default=repr)


@pytest.mark.parametrize("name", sorted(JOBS))
@pytest.mark.parametrize("workers", [2, 3])
def test_a_split_search_reports_what_one_process_does(name, workers, monkeypatch):
    monkeypatch.setattr(split_module, "MIN_SPLIT_CANDIDATES", 0)  # split these small searches too
    forks = []
    fork = os.fork

    def counted():
        pid = fork()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", counted)
    one = plan_job(_job(name))
    assert forks == []
    split = plan_job(_job(name), None, workers)
    assert len(forks) == workers - 1
    assert _report(split) == _report(one)
    assert split.evaluated == one.evaluated > 100
    assert one.rejected.counts.get("memory_over_budget", 0) > 0


def test_a_small_search_stays_in_one_process(monkeypatch):
    forks = []
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or 0)
    result = plan_job(_job("dense pp interleaved"), None, 4)
    assert forks == [] and result.layouts


def test_a_child_that_fails_leaves_its_triples_to_the_parent(monkeypatch):
    """Each child dies (its rows cannot be built, in the child only): the parent searches what they took."""
    monkeypatch.setattr(split_module, "MIN_SPLIT_CANDIDATES", 0)
    parent = os.getpid()
    row = split_module._row

    def broken(lay):
        if os.getpid() != parent:
            raise RuntimeError("child fault")
        return row(lay)

    monkeypatch.setattr(split_module, "_row", broken)
    one = plan_job(_job("moe long context"))
    split = plan_job(_job("moe long context"), None, 2)
    assert _report(split) == _report(one)


def test_rejections_extended_in_order_equal_one_record():
    """Rejections.extend: a record of an earlier part of the search extended by a later part's equals one record of
    both, a family seen in both parts included (its first reason, or its closest miss: a later miss replaces an
    earlier reason unless it is a larger miss)."""
    events = [("add", "too_few_micro_batches", "a", (1, 1)), ("miss", "m1", (1, 1), 9.0),
              ("add", "stages_imbalanced", "b", (1, 2)), ("miss", "m2", (2, 1), 5.0), ("miss", "m3", (1, 1), 7.0),
              ("add", "too_few_micro_batches", "c", (2, 2)), ("miss", "m4", (2, 2), 4.0), ("miss", "m5", (1, 1), 8.0),
              ("miss", "m6", (2, 1), 5.0), ("add", "pp_exceeds_layers", "d", (3, 1)), ("miss", "m7", (3, 1), 3.0),
              ("add", "too_few_micro_batches", "e", (1, 2)), ("miss", "m8", (1, 2), 6.0)]

    def record(part):
        rejected = Rejections()
        for event in part:
            if event[0] == "add":
                rejected.add(event[1], event[2], event[3])
            else:
                rejected.add_memory_miss(event[1], event[2], event[3])
        return rejected

    whole = record(events)
    for cut in range(len(events) + 1):
        merged = record(events[:cut])
        merged.extend(record(events[cut:]))
        assert (merged.counts, merged.examples, merged.family_reasons) == \
            (whole.counts, whole.examples, whole.family_reasons), cut
        assert list(merged.family_reasons) == list(whole.family_reasons)
        assert merged.memory_miss_bar((1, 1)) == whole.memory_miss_bar((1, 1)) == 7.0
