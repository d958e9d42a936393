"""The planner's memory per rank against PyTorch's MemTracker on the runtime's model (issue 4).

24 dense configurations spanning precision (fp32, bf16 autocast, bf16 FSDP mixed precision), AC mode,
ZeRO 0-3, TP with and without sequence parallelism, and pipeline stages of GPipe, 1F1B and
interleaved 1F1B; 13 Mixture-of-Experts ones (issue 24: AC none/selective/full, ZeRO 0-3, shared experts
and a dense first layer; ep 1 on fake tensors, ep 2 and 4 on a real gloo group of four processes); the context-parallel
ones (cp 2 and 4, the ring, with tp and dp) and two of context with expert parallelism (cp2 x dp2 at ep 2 and 4). Every MemTracker category and the total must agree within +-5 % (components
under 20 % of the total: within 1 % of the total). The same table: `python bench/memory_accuracy.py`.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
# The module fixture measures every configuration once per session (a few minutes) under a file lock: the
# xdist_group mark would keep the module on one worker under --dist loadgroup, but with pytest 9.2 it does not
# (scripts/test), and each worker would otherwise repeat the measurement.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.xdist_group("memory_truth")]

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


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    """Measured once per test session: the first worker to get here measures under a file lock and
    leaves the figures beside the workers' temp folders; every other worker (and a module set up
    again on the same worker) reads them. (pytest-xdist's documented way to run a fixture once;
    --dist loadgroup alone still let three workers measure side by side.)"""
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") \
        else tmp_path_factory.getbasetemp()
    cache = shared / f"memory-truth-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'solo')}.json"
    with open(shared / "memory-truth.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cache.exists():
            return json.loads(cache.read_text())
        figures = dict(zip(NAMES, accuracy.measure_all(accuracy.CONFIGS)))
        cache.write_text(json.dumps(figures))
        return figures


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
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="peak moment not in the planner's phases (issue 12)"))
    if n in PEAK_MOMENT_GAPS else n for n in NAMES])
def test_planner_matches_memtracker(name, measured):
    cfg = next(c for c in accuracy.CONFIGS if c.name == name)
    predicted = accuracy.predict(cfg)
    result = accuracy.check(predicted, measured[name])
    off = {key: f"planner {predicted[key] / 2**20:.1f} MiB vs measured {measured[name][key] / 2**20:.1f} MiB"
           for key, (_, ok) in result.items() if not ok}
    assert not off, off


def test_totals_of_known_gaps_stay_close(measured):
    """The configurations marked as gaps above still agree on the total within 5 %."""
    for cfg in accuracy.CONFIGS:
        if cfg.name in PEAK_MOMENT_GAPS:
            predicted = accuracy.predict(cfg)["Total"]
            assert abs(predicted / measured[cfg.name]["Total"] - 1) <= 0.05, cfg.name
