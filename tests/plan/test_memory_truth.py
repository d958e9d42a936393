"""The planner's memory per rank against PyTorch's MemTracker on the runtime's model (issue 4).

24 configurations spanning precision (fp32, bf16 autocast, bf16 FSDP mixed precision), AC mode,
ZeRO 0-3, TP with and without sequence parallelism, and pipeline stages of GPipe, 1F1B and
interleaved 1F1B. Every MemTracker category and the total must agree within +-5 % (components
under 20 % of the total: within 1 % of the total). The same table: `python bench/memory_accuracy.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Imported by name from bench/ (on sys.path, which spawned gloo workers inherit) so that its
# worker function and configurations pickle.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import memory_accuracy as accuracy  # noqa: E402

NAMES = [cfg.name for cfg in accuracy.CONFIGS]


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, float]]:
    return dict(zip(NAMES, accuracy.measure_all(accuracy.CONFIGS)))


def test_enough_configurations():
    kinds = {cfg.kind for cfg in accuracy.CONFIGS}
    assert len(accuracy.CONFIGS) >= 20 and kinds == {"fake", "real", "gloo"}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", NAMES)
def test_planner_matches_memtracker(name, measured):
    cfg = next(c for c in accuracy.CONFIGS if c.name == name)
    predicted = accuracy.predict(cfg)
    result = accuracy.check(predicted, measured[name])
    off = {key: f"planner {predicted[key] / 2**20:.1f} MiB vs measured {measured[name][key] / 2**20:.1f} MiB"
           for key, (_, ok) in result.items() if not ok}
    assert not off, off
