"""The search's memory memo (plan/memory.py `cache`) gives every candidate exactly the breakdown that a
fresh evaluation gives: a cache key that missed a field the terms read would fail here."""

from __future__ import annotations

import pytest

import hpctrain.plan.search as search_module
from hpctrain.config import job_from_dict
from hpctrain.plan import plan_job
from hpctrain.plan.memory import peak_rank_memory

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
    "lora fp32": {"model": {"preset": "llama3-8b"}, "train": {"global_batch": 32, "precision": "fp32",
                                                               "lora": {"rank": 16}},
                  "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "a100-80gb", "node": "dgx-a100",
                              "fabric": "ib-hdr200"}},
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_memoised_memory_equals_a_fresh_evaluation(name, monkeypatch):
    spec = {"name": "memo", "parallel": FREE, **JOBS[name]}
    spec["train"] = {"micro_batch": "auto", "activation_checkpointing": "auto", **spec["train"]}
    calls = []

    def checked(model, stage_layers, setup, cache=None):
        assert cache is not None  # the search passes its memo
        memoised = peak_rank_memory(model, stage_layers, setup, cache)
        assert memoised == peak_rank_memory(model, stage_layers, setup), setup
        calls.append(setup)
        return memoised

    monkeypatch.setattr(search_module, "peak_rank_memory", checked)
    result = plan_job(job_from_dict(spec))
    assert len(calls) == result.evaluated > 20
    assert result.layouts
