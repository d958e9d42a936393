"""The planner's memory with context parallelism against PyTorch's MemTracker (issue 25): what is measured.

bench/memory_accuracy.py's CP_CONFIGS (cp2 fp32, cp2 bf16, cp4 selective, cp2 x tp2 with sequence parallelism,
cp2 x dp2 zero 3 full recomputation, the ring at cp2 and cp4: real tensors on the runtime's model over the fake process
group) and CP_EP_CONFIGS (cp2 x dp2 at ep2 zero 1 and at ep4 zero 3 with the ring: real all-to-alls and K/V exchanges
in a gloo group of four, the experts over efsdp = dp x cp / ep) are part of its CONFIGS, so
tests/plan/test_memory_truth.py measures each once and holds every category and the total to the bench's tolerance.
(This file measured them a second time, about 105 s of a CI worker: the same configurations, the same check.) Here:
that they are there, and that they span what issue 25 asks of them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import memory_accuracy as accuracy  # noqa: E402


def test_the_context_parallel_configurations_are_measured_with_the_others():
    names = [cfg.name for cfg in accuracy.CONFIGS]
    for cfg in accuracy.CP_CONFIGS + accuracy.CP_EP_CONFIGS:
        assert cfg.job().parallel.cp > 1 and names.count(cfg.name) == 1, cfg.name


def test_the_context_parallel_configurations_span_the_layouts_and_both_rotations():
    par = [cfg.job().parallel for cfg in accuracy.CP_CONFIGS]
    train = [cfg.job().train for cfg in accuracy.CP_CONFIGS]
    assert {p.cp for p in par} >= {2, 4}
    assert {p.cp_rotate for p in par} == {"allgather", "ring"}
    assert any(p.tp > 1 and p.sequence_parallel for p in par) and any(p.dp > 1 and p.zero == 3 for p in par)
    assert {t.activation_checkpointing for t in train} == {"none", "selective", "full"}
    assert {t.precision for t in train} >= {"fp32", "bf16"}
    ep = [cfg.job().parallel for cfg in accuracy.CP_EP_CONFIGS]
    assert {p.ep for p in ep} >= {2, 4} and {p.cp_rotate for p in ep} == {"allgather", "ring"}
    assert all(cfg.kind == "gloo" for cfg in accuracy.CP_EP_CONFIGS)  # real all-to-alls and K/V exchanges
