"""The planner's memory with context parallelism against PyTorch's MemTracker (issue 25).

Five configurations (bench/memory_accuracy.py CP_CONFIGS: cp2 fp32, cp2 bf16, cp4 selective, cp2 x tp2 with
sequence parallelism, cp2 x dp2 zero 3 full recomputation), real tensors on the runtime's model over the
fake process group; every category and the total within the bench's tolerance. With expert parallelism too
(CP_EP_CONFIGS: cp2 x dp2 at ep2 zero 1 and at ep4 zero 3 with the ring): real all-to-alls and K/V exchanges in
a gloo group of four, the experts over efsdp = dp x cp / ep."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.dist, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import memory_accuracy as accuracy  # noqa: E402


@pytest.mark.parametrize("configs", [accuracy.CP_CONFIGS, accuracy.CP_EP_CONFIGS], ids=["cp", "cp x ep"])
def test_planner_matches_memtracker_with_context_parallelism(configs: list) -> None:
    assert len(configs) >= 2 and all(cfg.job().parallel.cp > 1 for cfg in configs)
    measured = accuracy.measure_all(configs)
    off = {}
    for cfg, meas in zip(configs, measured):
        predicted = accuracy.predict(cfg)
        result = accuracy.check(predicted, meas)
        assert abs(predicted["Total"] / meas["Total"] - 1) <= accuracy.TOLERANCE, cfg.name
        off.update({f"{cfg.name} {key}": f"planner {predicted[key] / 2**20:.1f} MiB vs measured {meas[key] / 2**20:.1f} MiB"
                    for key, (_, ok) in result.items() if not ok})
    assert not off, off
