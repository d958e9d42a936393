"""The runtime's expert load per expert-parallel degree (runtime/model/moe.py `expert_rank_loads`): what
metrics.jsonl's expert_load_ep<N> say and `hpctrain plan --expert-load` prices."""

from __future__ import annotations

import pytest
import torch

from hpctrain.runtime.model.moe import expert_rank_loads


def test_each_ep_groups_the_experts_in_contiguous_blocks_as_the_runtime_places_them():
    counts = torch.tensor([[4.0, 0.0, 2.0, 2.0],    # ep 2: ranks [4, 4] -> 1.0; ep 4: 4 over 2 -> 2.0
                           [0.0, 0.0, 0.0, 0.0],    # routed nothing (a layer not run this step): left out
                           [6.0, 2.0, 0.0, 0.0]], dtype=torch.float64)  # ep 2: [8, 0] -> 2.0; ep 4: 6 over 2 -> 3.0
    assert expert_rank_loads(counts) == {"expert_load_ep2": pytest.approx(1.5), "expert_load_ep4": pytest.approx(2.5)}


def test_coarser_ep_is_never_less_balanced_and_only_divisors_are_reported():
    torch.manual_seed(0)
    counts = torch.randint(0, 100, (5, 12)).to(torch.float64)
    got = expert_rank_loads(counts)
    assert sorted(int(k.removeprefix("expert_load_ep")) for k in got) == [2, 3, 4, 6, 12]
    # a block of experts is as loaded as its experts' mean: nested groupings can only lower the busiest ratio
    for fine, coarse in ((12, 6), (12, 4), (6, 3), (6, 2), (4, 2)):
        assert got[f"expert_load_ep{coarse}"] <= got[f"expert_load_ep{fine}"] + 1e-12
    assert all(v >= 1.0 for v in got.values())
    assert expert_rank_loads(torch.zeros(3, 4, dtype=torch.float64)) == {}
