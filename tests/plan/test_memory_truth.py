"""The planner's memory per rank against PyTorch's MemTracker on the runtime's model (issue 4).

24 dense configurations spanning precision (fp32, bf16 autocast, bf16 FSDP mixed precision), AC mode,
ZeRO 0-3, TP with and without sequence parallelism, and pipeline stages of GPipe, 1F1B and
interleaved 1F1B; 13 Mixture-of-Experts ones (issue 24: AC none/selective/full, ZeRO 0-3, shared experts
and a dense first layer; ep 1 on fake tensors, ep 2 and 4 on a real gloo group of four processes); the context-parallel
ones (cp 2 and 4, the ring, with tp and dp) and two of context with expert parallelism (cp2 x dp2 at ep 2 and 4). Every MemTracker category and the total must agree within +-5 % (components
under 20 % of the total: within 1 % of the total). The same table: `python bench/memory_accuracy.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
# One test measures every configuration (a few minutes) and checks them all: as one item it runs on one xdist worker
# while the others go on. (A module fixture shared by one item per configuration made the other workers wait on its
# lock for the whole measurement: pytest 9.2's node ids lose xdist's "@group" suffix, so --dist loadgroup no longer
# keeps a module on one worker, scripts/test.)
pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Imported by name from bench/ (on sys.path, which spawned gloo workers inherit) so that its
# worker function and configurations pickle.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import memory_accuracy as accuracy  # noqa: E402

NAMES = [cfg.name for cfg in accuracy.CONFIGS]
# Issue 12 changed what the runtime keeps (16-bit activations under autocast, RMSNorm saving its
# input and rstd only, sequence-parallel shards, pipeline buffers bounded by the schedule, FSDP
# units of their own); the planner follows (hpctrain/plan/activations.py, memory.py), including
# the later backward moments where the peak moved (w2's backward with gradients held, the FFN
# norm's backward, the embedding's backward). Left: interleaved 1F1B's first stage peaks in the
# embedding's backward with about 1.5 MiB more gradient buffers than the planner counts (the
# total stays within 1.5 %). Strict, so a fix shows.
PEAK_MOMENT_GAPS = {"pp2 interleaved v2 bf16 first stage"}


def test_enough_configurations():
    kinds = {cfg.kind for cfg in accuracy.CONFIGS}
    assert len(accuracy.CONFIGS) >= 20 and kinds == {"fake", "real", "gloo"}
    moe = [cfg.job().parallel for cfg in accuracy.CONFIGS if "moe" in cfg.model]
    moe_train = [cfg.job().train for cfg in accuracy.CONFIGS if "moe" in cfg.model]
    assert len(moe) >= 6
    # issue 24's acceptance: ep 1/2/4, zero 1 and 3, with and without activation checkpointing
    assert {p.ep for p in moe} >= {1, 2, 4}
    for ep in (2, 4):
        assert {p.zero for p in moe if p.ep == ep} >= {1, 3}
    assert {t.activation_checkpointing for t, p in zip(moe_train, moe) if p.ep > 1} >= {"none", "selective", "full"}


@pytest.mark.timeout(1800)
def test_planner_matches_memtracker_on_every_configuration():
    """Every configuration within the tolerances (bench/memory_accuracy.py's `check`), but the known peak-moment gaps,
    which must still miss (strict: a fix shows) and stay within 5 % on the total."""
    measured = dict(zip(NAMES, accuracy.measure_all(accuracy.CONFIGS)))
    failures, fixed = {}, []
    for cfg in accuracy.CONFIGS:
        predicted = accuracy.predict(cfg)
        result = accuracy.check(predicted, measured[cfg.name])
        off = {key: f"planner {predicted[key] / 2**20:.1f} MiB vs measured {measured[cfg.name][key] / 2**20:.1f} MiB"
               for key, (_, ok) in result.items() if not ok}
        if cfg.name in PEAK_MOMENT_GAPS:
            if not off:
                fixed.append(cfg.name)
            assert abs(predicted["Total"] / measured[cfg.name]["Total"] - 1) <= 0.05, cfg.name
        elif off:
            failures[cfg.name] = off
    assert not failures, failures
    assert not fixed, f"now within the tolerances, drop from PEAK_MOMENT_GAPS: {fixed}"
