"""Parameter counts and FLOPs against published figures (table-driven)."""

from __future__ import annotations

import pytest

from hpctrain.plan.model_stats import (
    flops_per_token,
    model_flops_per_token,
    param_count,
    param_counts,
    stage_param_count,
)
from .shapes import GPT3_175B, GPT_1T, LLAMA2_7B, LLAMA3_8B, LLAMA3_70B, shape


@pytest.mark.parametrize(
    "model, expected",
    [
        # Hugging Face model cards / sum(p.numel()) of the reference implementations.
        (LLAMA3_8B, 8_030_261_248),
        (LLAMA2_7B, 6_738_415_616),
        (LLAMA3_70B, 70_553_706_496),
    ],
)
def test_param_count_matches_published_llama(model, expected):
    assert param_count(model) == expected


@pytest.mark.parametrize("model, billions", [(GPT3_175B, 174.6), (GPT_1T, 1008.0)])
def test_param_count_gpt_without_biases(model, billions):
    # GPT-3 175B and Megatron's 1T counted without biases and position embeddings.
    assert param_count(model) / 1e9 == pytest.approx(billions, rel=2e-3)


def test_tied_head_counted_once():
    untied, tied = shape(tie_embeddings=False), shape(tie_embeddings=True)
    assert param_count(untied) - param_count(tied) == 64 * 1000
    assert param_counts(tied).head == 0


def test_stage_counts_sum_to_model_without_tp():
    m = shape(layers=6)
    parts = [(0, 2, True, False), (2, 4, False, False), (4, 6, False, True)]
    total = sum(stage_param_count(m, a, b, has_embedding=e, has_head=h) for a, b, e, h in parts)
    assert total == param_count(m)


def test_stage_count_with_tp_shards_matrices_not_norms():
    m = shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=256, vocab=1000)
    full = stage_param_count(m, 0, 2, has_embedding=True, has_head=True, tp=1)
    half = stage_param_count(m, 0, 2, has_embedding=True, has_head=True, tp=2)
    norms = 2 * 2 * 64 + 64
    assert half == (full - norms) // 2 + norms


def test_flops_match_torchtitan_formula_for_llama3_8b():
    # torchtitan: 6 * (params - embedding) + 12 * layers * heads * head_dim * seq_len
    m = LLAMA3_8B
    expected = 6 * (param_count(m) - m.vocab * m.hidden - m.hidden - 2 * m.hidden * m.layers) \
        + 12 * m.layers * m.heads * (m.hidden // m.heads) * m.seq_len
    assert model_flops_per_token(m) == pytest.approx(expected, rel=1e-12)


def test_flops_match_megatron_formula_with_full_recompute():
    # Narayanan et al. 2021, eq. 3: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), GPT shape.
    m = GPT_1T
    s, l, h, v = m.seq_len, m.layers, m.hidden, m.vocab
    per_token = 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert flops_per_token(m, "full") == pytest.approx(per_token, rel=1e-12)


def test_recompute_order():
    m = LLAMA3_8B
    assert flops_per_token(m, "none") == flops_per_token(m, "selective") < flops_per_token(m, "full")
    with pytest.raises(ValueError):
        flops_per_token(m, "sometimes")
