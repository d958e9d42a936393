"""The pipeline rank that paces the step, and a published run's own split (issue 26: the corpus prices what the
publisher ran). The rank holding the head and loss paces the pipeline when its layers and the head take longer than
the busiest rank's layers (cost_setup.CostSetup.head_rank_layers); Megatron-Core's --account-for-embedding/loss split
counts each as one layer (stages.megatron_unit_split), which leaves a large-vocabulary model's last rank the slowest.
Torch-free."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpctrain.config import job_from_dict
from hpctrain.plan.cost import head_time_per_token_s, step_cost
from hpctrain.plan.cost_setup import CostSetup
from hpctrain.plan.moe_cost import MOE_SYNC_HOST_S
from hpctrain.plan.hardware import resolve_hardware
from hpctrain.plan.stages import balanced_stage_split, megatron_unit_split

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planner_accuracy as bench  # noqa: E402

QWEN = {"name": "q", "model": {"preset": "qwen3-235b-a22b", "seq_len": 4096},
        "train": {"global_batch": 2048, "micro_batch": 1, "activation_checkpointing": "selective"},
        "parallel": {"tp": 2, "pp": 32, "dp": 4, "ep": 8, "zero": 1, "sequence_parallel": True, "schedule": "1f1b"},
        "cluster": {"nodes": 32, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}}


def test_megatron_units_cut_layers_plus_embedding_and_loss_into_equal_chunks():
    job = job_from_dict(QWEN)  # 94 layers
    split = megatron_unit_split(job.model, 32)  # 96 units, 3 a chunk: the first and last chunks hold 2 layers
    assert split[0] == (0, 2) and split[-1] == (92, 94) and all(b - a == 3 for a, b in split[1:-1])
    one_unit = megatron_unit_split(job.model, 8, 12)  # 96 one-unit chunks: the embedding's and the loss's hold none
    assert one_unit[0] == (0, 0) and one_unit[-1] == (94, 94) and len(one_unit) == 96
    assert [b - a for a, b in one_unit[1:-1]] == [1] * 94
    with pytest.raises(ValueError, match="96 units do not split into 28 equal chunks"):
        megatron_unit_split(job.model, 4, 7)
    # hpctrain's own split gives the head's stage fewer layers instead
    balanced = balanced_stage_split(job.model, 32)
    assert balanced[-1][1] - balanced[-1][0] < 3


def _setup(**kw) -> CostSetup:
    base = dict(tp=2, pp=32, dp=4, micro_batch=1, micro_batches=512, virtual_stages=1, ac="selective", zero=1,
                offload_optimizer=False, precision="bf16", max_rank_layers=3, max_rank_has_head=False, rank_params=1e9,
                sequence_parallel=True, ep=8)
    return CostSetup(**{**base, **kw})


def test_the_heads_rank_paces_the_pipeline_when_it_is_slower():
    job = job_from_dict(QWEN)
    hw = resolve_hardware(job)
    model = job.model
    # without the MoE blocks' host syncs (moe_cost.MOE_SYNC_HOST_S; their own test below)
    unknown = step_cost(model, hw, _setup(moe_sync="none"), 2048)
    lighter = step_cost(model, hw, _setup(head_rank_layers=0, moe_sync="none"), 2048)  # the head alone: lighter
    heavier = step_cost(model, hw, _setup(head_rank_layers=2, moe_sync="none"), 2048)  # 2 blocks + the head: heavier
    assert lighter.step_time_s == pytest.approx(unknown.step_time_s, rel=1e-12)
    assert heavier.step_time_s > unknown.step_time_s
    # the slot is the head rank's: two thirds of every per-layer term, plus the head
    head_mb = 4096 * head_time_per_token_s(model, hw, 2, "bf16")
    assert heavier.compute_s / 512 == pytest.approx(unknown.compute_s / 512 * 2 / 3 + head_mb, rel=1e-9)
    assert heavier.a2a_s == pytest.approx(unknown.a2a_s * 2 / 3, rel=1e-9)
    # a block's host sync is a per-layer term too: 1.7 ms x 3 blocks per micro-batch on the busiest rank; with it
    # the three blocks outweigh two and the head, and the busiest rank paces the pipeline again
    synced = step_cost(model, hw, _setup(), 2048)
    assert synced.host_s == pytest.approx(512 * 3 * MOE_SYNC_HOST_S, rel=1e-12)
    assert synced.step_time_s == pytest.approx(step_cost(model, hw, _setup(head_rank_layers=2), 2048).step_time_s,
                                               rel=1e-12)
    # a rank that holds the head and is the busiest already counts it once
    both = step_cost(model, hw, _setup(max_rank_has_head=True, head_rank_layers=3), 2048)
    assert both.step_time_s == pytest.approx(step_cost(model, hw, _setup(max_rank_has_head=True), 2048).step_time_s)


def test_a_published_megatron_split_prices_the_row_slower_than_a_balanced_one():
    runs = {run["name"]: run for run in bench.load_corpus()}
    row = runs["mz-qwen3-235b-ep8-pp32"]
    assert row["stage_split"] == "megatron-units"
    _, megatron, _ = bench.predict(row)
    _, balanced, _ = bench.predict({k: v for k, v in row.items() if k != "stage_split"})
    assert megatron.stage_layers[-1] == (92, 94) and megatron.cost.step_time_s > balanced.cost.step_time_s
    with pytest.raises(SystemExit, match="stage_split must be one of balanced, megatron-units"):
        bench.predict({**row, "stage_split": "even"})
    # a (pp, v) Megatron-Core cannot split (94 + 2 units into 8 x 5 chunks) is no candidate of such a row
    interleaved = {**row, "layout": {**row["layout"], "pp": 8, "dp": 16, "schedule": "interleaved-1f1b",
                                     "virtual_stages": 5}}
    bench.predict({k: v for k, v in interleaved.items() if k != "stage_split"})  # hpctrain's own split takes it
    with pytest.raises(SystemExit, match="the published layout is not a valid candidate"):
        bench.predict(interleaved)
