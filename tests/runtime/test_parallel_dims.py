"""ParallelDims: degree validation needs no process group and names the field."""

from __future__ import annotations

import pytest

from hpctrain.errors import ConfigError
from hpctrain.runtime.model.transformer import ModelArgs
from hpctrain.runtime.parallel.dims import ParallelDims


def test_enabled_flags_and_coords() -> None:
    dims = ParallelDims(pp=2, dp=3, tp=4, world_size=24)
    assert (dims.pp_enabled, dims.dp_enabled, dims.tp_enabled) == (True, True, True)
    assert not ParallelDims(pp=1, dp=1, tp=1, world_size=1).pp_enabled
    # arange(24).view(2, 3, 4): tp innermost, pp outermost
    assert dims.coords(0) == {"pp": 0, "dp": 0, "tp": 0}
    assert dims.coords(5) == {"pp": 0, "dp": 1, "tp": 1}
    assert dims.coords(23) == {"pp": 1, "dp": 2, "tp": 3}


def test_context_parallel_coords_are_torchtitans_grid() -> None:
    """cp between dp and tp: arange(world).view(pp, dp, cp, tp), FSDP over dp x cp."""
    import torch

    dims = ParallelDims(pp=2, dp=2, tp=2, cp=3, world_size=24)
    grid = torch.arange(24).view(2, 2, 3, 2)
    for rank in range(24):
        c = dims.coords(rank)
        assert int(grid[c["pp"], c["dp"], c["cp"], c["tp"]]) == rank
    assert (dims.cp_enabled, dims.dp_cp) == (True, 6)
    assert "cp" not in ParallelDims(pp=1, dp=2, tp=1, world_size=2).coords(1)


def test_chunk_positions_are_a_head_and_its_mirror_tail() -> None:
    """Every position once over the cp ranks; each rank's queries see the same number of keys causally."""
    import torch

    from hpctrain.runtime.parallel.context import chunk_positions, shard_sequence

    assert chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (1, 2, 4):
        held = torch.cat([chunk_positions(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))
        work = {int((chunk_positions(32, cp, r) + 1).sum()) for r in range(cp)}  # keys seen, causal
        assert len(work) == 1, (cp, work)
    tokens = torch.arange(32).view(2, 16)
    assert shard_sequence(tokens, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]]
    with pytest.raises(ConfigError, match=r"model.seq_len: got 12; must be a multiple of 2 x parallel.cp = 8"):
        chunk_positions(12, 4, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pp=2, dp=2, tp=2, world_size=4), "world size is 4"),
        (dict(pp=0, dp=1, tp=1, world_size=0), "parallel.pp: got 0"),
        (dict(pp=1, dp="auto", tp=1, world_size=1), "parallel.dp: got 'auto'"),
        (dict(pp=1, dp=1, tp=True, world_size=1), "parallel.tp: got True"),
        (dict(pp=1, dp=6, tp=1, world_size=6, ep=4), r"parallel.ep: got 4; must divide parallel.dp x parallel.tp = 6"),
        (dict(pp=1, dp=2, tp=2, world_size=4, ep=8), r"parallel.ep: got 8; must divide parallel.dp x parallel.tp = 4"),
        (dict(pp=1, dp=3, tp=2, world_size=6, ep=3), r"parallel.ep: got 3; must be a multiple of parallel.tp=2"),
        (dict(pp=1, dp=2, tp=1, world_size=2, ep=0), "parallel.ep: got 0"),
        (dict(pp=1, dp=2, tp=1, world_size=2, cp=2), r"dp=2 x cp=2 x tp=1 = 4, but the world size is 2"),
        # context parallelism folds into the experts' grouping: ep divides dp x cp x tp (and stays a multiple of tp)
        (dict(pp=1, dp=1, tp=1, world_size=2, cp=2, ep=4),
         r"parallel.ep: got 4; must divide parallel.dp x parallel.cp x parallel.tp = 2 .*; use a divisor of 2"),
        (dict(pp=1, dp=1, tp=2, world_size=8, cp=4, ep=3), r"parallel.ep: got 3; must divide .* = 8"),
        (dict(pp=1, dp=1, tp=4, world_size=8, cp=2, ep=2), r"parallel.ep: got 2; must be a multiple of parallel.tp=4"),
    ],
)
def test_bad_degrees(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ParallelDims(**kwargs)


def test_model_divisibility() -> None:
    model = ModelArgs(layers=3, hidden=48, heads=6, kv_heads=2, ffn_hidden=100, vocab=64, seq_len=8)
    ParallelDims(pp=3, dp=1, tp=2, world_size=6).validate_model(model)
    with pytest.raises(ConfigError) as err:
        ParallelDims(pp=1, dp=1, tp=4, world_size=4).validate_model(model)
    assert any("model.heads" in p for p in err.value.problems)
    assert any("model.kv_heads" in p for p in err.value.problems)
    with pytest.raises(ConfigError, match="model.layers"):
        ParallelDims(pp=2, dp=1, tp=1, world_size=2).validate_model(model, virtual_stages=2)


def test_expert_parallel_borrows_from_dp() -> None:
    dims = ParallelDims(pp=2, dp=4, tp=1, world_size=8, ep=2)
    assert dims.ep_enabled and dims.efsdp == 2
    assert not ParallelDims(pp=1, dp=4, tp=1, world_size=4).ep_enabled
    # with tensor parallelism the experts' region spans dp x tp: ep4 over dp2 x tp2 leaves efsdp 1
    assert ParallelDims(pp=1, dp=2, tp=2, world_size=4, ep=4).efsdp == 1
    assert ParallelDims(pp=1, dp=4, tp=2, world_size=8, ep=2).efsdp == 4
    # and with context parallelism over dp x cp x tp (runtime/parallel/expert.py)
    assert ParallelDims(pp=1, dp=1, tp=1, world_size=2, cp=2, ep=2).efsdp == 1
    assert ParallelDims(pp=1, dp=2, tp=1, world_size=4, cp=2, ep=2).efsdp == 2
    assert ParallelDims(pp=2, dp=2, tp=2, world_size=16, cp=2, ep=4).efsdp == 2
