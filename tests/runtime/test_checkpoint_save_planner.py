"""runtime/checkpoint/save_planner.py: a save writes the bytes DCP's default planner writes, with one
torch.save per distinct plain value, and loads back through the checkpointer's safe reader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

from hpctrain.runtime.checkpoint.safe_dcp import SafePlanner, SafeReader  # noqa: E402
from hpctrain.runtime.checkpoint.save_planner import SavePlanner  # noqa: E402


def _state() -> dict[str, dict[str, object]]:
    """A flattened-optimizer-like state: tensors, and per-parameter settings that repeat (1 and 1.0 and True
    among them, which must not share bytes)."""
    optim: dict[str, object] = {}
    for name in ("a", "b", "c"):
        optim[f"state.{name}.exp_avg"] = torch.arange(6, dtype=torch.float32) + len(name)
        optim.update({f"param_groups.{name}.lr": 1e-3, f"param_groups.{name}.betas": (0.9, 0.95),
                      f"param_groups.{name}.fused": True, f"param_groups.{name}.foreach": None,
                      f"param_groups.{name}.step_int": 1, f"param_groups.{name}.step_float": 1.0,
                      f"param_groups.{name}.pair": [1, 2.0]})
    return {"model": {"w": torch.ones(3, 2)}, "optim": optim}


def _data_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".distcp"}


def test_the_same_bytes_as_the_default_planner_with_one_serialisation_per_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dcp.save(_state(), storage_writer=FileSystemWriter(str(tmp_path / "default"), sync_files=False),
             planner=DefaultSavePlanner())
    calls: list[object] = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, *a, **k: (calls.append(obj), real_save(obj, *a, **k))[1])
    dcp.save(_state(), storage_writer=FileSystemWriter(str(tmp_path / "memo"), sync_files=False),
             planner=SavePlanner())
    monkeypatch.setattr(torch, "save", real_save)
    assert _data_files(tmp_path / "memo") == _data_files(tmp_path / "default")
    plain = [c for c in calls if not isinstance(c, torch.Tensor)]
    # 3 parameters x 7 settings, of which 7 distinct values (1, 1.0 and True each their own)
    assert len(plain) == 7

    optim = {k: (torch.zeros(6) if isinstance(v, torch.Tensor) else None) for k, v in _state()["optim"].items()}
    loaded = {"model": {"w": torch.zeros(3, 2)}, "optim": optim}
    dcp.load(loaded, storage_reader=SafeReader(str(tmp_path / "memo")), planner=SafePlanner())
    want = _state()
    assert torch.equal(loaded["model"]["w"], want["model"]["w"])  # type: ignore[arg-type]
    for key, value in want["optim"].items():
        got = loaded["optim"][key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, value)  # type: ignore[arg-type]
        else:
            assert got == value and type(got) is type(value), key
    assert os.path.exists(tmp_path / "memo" / ".metadata")
