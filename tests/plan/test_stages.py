"""Balanced pipeline splits."""

from __future__ import annotations

import pytest

from hpctrain.plan.stages import (
    balanced_stage_split,
    rank_training_flops_per_token,
    stage_imbalance,
    stage_of_layer,
)
from .shapes import GPT3_175B, GPT_1T, LLAMA3_8B, shape


@pytest.mark.parametrize("model", [LLAMA3_8B, GPT3_175B, GPT_1T, shape(layers=7)])
@pytest.mark.parametrize("pp, v", [(1, 1), (2, 1), (4, 1), (2, 2), (7, 1)])
def test_split_covers_all_layers_contiguously(model, pp, v):
    if model.layers < pp * v:
        with pytest.raises(ValueError):
            balanced_stage_split(model, pp, v)
        return
    split = balanced_stage_split(model, pp, v)
    assert len(split) == pp * v
    assert split[0][0] == 0 and split[-1][1] == model.layers
    assert all(a < b for a, b in split)
    assert all(split[i][1] == split[i + 1][0] for i in range(len(split) - 1))


def test_heavy_head_takes_layers_off_the_last_stage():
    # Llama 3 8B: the 128k-vocab head costs about 1.8 layers, so the last stage holds fewer.
    split = balanced_stage_split(LLAMA3_8B, 4, 1)
    sizes = [b - a for a, b in split]
    assert sizes[-1] < max(sizes)
    assert stage_imbalance(LLAMA3_8B, split, 4) < 0.15


def test_split_is_optimal_against_brute_force():
    m = shape(layers=9, hidden=64, vocab=20000)
    split = balanced_stage_split(m, 3, 1)
    best = min(
        max(rank_training_flops_per_token(m, [(0, a), (a, b), (b, 9)], 3))
        for a in range(1, 8) for b in range(a + 1, 9)
    )
    assert max(rank_training_flops_per_token(m, split, 3)) == pytest.approx(best)


def test_one_layer_per_stage_with_big_head_is_imbalanced():
    split = balanced_stage_split(LLAMA3_8B, 32, 1)
    assert stage_imbalance(LLAMA3_8B, split, 32) > 0.15


def test_interleaved_ranks_sum_their_virtual_stages():
    m = shape(layers=8)
    split = balanced_stage_split(m, 2, 2)
    per_rank = rank_training_flops_per_token(m, split, 2)
    assert len(per_rank) == 2
    assert stage_of_layer(split, 0) == 0 and stage_of_layer(split, 7) == 3
