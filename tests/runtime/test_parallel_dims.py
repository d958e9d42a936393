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
