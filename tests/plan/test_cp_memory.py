"""The planner's memory with context parallelism against PyTorch's MemTracker (issue 25).

Five configurations (bench/memory_accuracy.py CP_CONFIGS: cp2 fp32, cp2 bf16, cp4 selective, cp2 x tp2 with
sequence parallelism, cp2 x dp2 zero 3 full recomputation), real tensors on the runtime's model over the
fake process group; every category and the total within the bench's tolerance."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.dist, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import memory_accuracy as accuracy  # noqa: E402


def test_planner_matches_memtracker_with_context_parallelism() -> None:
    configs = accuracy.CP_CONFIGS
    assert len(configs) >= 4 and all(cfg.job().parallel.cp > 1 for cfg in configs)
    measured = accuracy.measure_all(configs)
    off = {}
    for cfg, meas in zip(configs, measured):
        predicted = accuracy.predict(cfg)
        result = accuracy.check(predicted, meas)
        assert abs(predicted["Total"] / meas["Total"] - 1) <= accuracy.TOLERANCE, cfg.name
        off.update({f"{cfg.name} {key}": f"planner {predicted[key] / 2**20:.1f} MiB vs measured {meas[key] / 2**20:.1f} MiB"
                    for key, (_, ok) in result.items() if not ok})
    assert not off, off
