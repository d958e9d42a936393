"""The doctor on real runs of this machine: the runtime on gloo/CPU ranks, started by the local executor.

Each run exhibits one finding for real: an imbalanced pipeline split, communication dominating a
step (many tiny layers, TP over gloo), a memory cap (ulimit -v) that makes an allocation fail, and
a healthy single-rank run with nothing to report. The machine has 2 cores: runs are tiny and short.
"""

from __future__ import annotations

import sys

import pytest

from hpctrain.diagnose.doctor import diagnose_run

from ._real import cpu_job, run_local
from ._runs import assert_fixes_replan

pytestmark = [pytest.mark.timeout(300), pytest.mark.dist, pytest.mark.slow]


def _families(diagnosis):
    return [f.family for f in diagnosis.findings]


def test_real_healthy_single_rank_run_has_no_findings(tmp_path):
    run = run_local(tmp_path, cpu_job(parallel={"dp": 1}, cluster={"gpus_per_node": 1}, train={"steps": 6}))
    diagnosis = diagnose_run(run)
    assert diagnosis.state == "finished"
    assert diagnosis.findings == [], [f.title for f in diagnosis.findings]


def test_real_imbalanced_pipeline_split(tmp_path):
    job = cpu_job(model={"preset": "tiny", "layers": 6, "hidden": 128, "heads": 4, "kv_heads": 2, "seq_len": 64},
                  parallel={"tp": 1, "pp": 2, "dp": 1, "schedule": "1f1b", "virtual_stages": 1})
    run = run_local(tmp_path, job, stage_layers=[[0, 1], [1, 6]])  # 1 layer + embedding vs 5 layers + head
    diagnosis = diagnose_run(run)
    assert "imbalance" in _families(diagnosis)
    finding = next(f for f in diagnosis.findings if f.family == "imbalance")
    assert finding.title.startswith("pipeline stage 1 is the slowest")
    text = "\n".join(finding.evidence)
    assert "pipeline stage 0: layers [0, 1) + embedding" in text
    assert "pipeline stage 1: layers [1, 6) + head and loss" in text
    assert "the planner's balanced split for this layout is [[0, 3], [3, 6]]" in text
    assert finding.fixes
    assert_fixes_replan(run, finding)


def test_real_communication_dominates_with_many_tiny_tp_layers(tmp_path):
    job = cpu_job(model={"preset": "tiny", "layers": 8, "kv_heads": 4, "seq_len": 8},
                  parallel={"tp": 4, "pp": 1, "dp": 1}, train={"global_batch": 2, "micro_batch": 1, "steps": 3},
                  cluster={"gpus_per_node": 4})
    run = run_local(tmp_path, job)
    diagnosis = diagnose_run(run)
    assert "comm" in _families(diagnosis)
    finding = next(f for f in diagnosis.findings if f.family == "comm")
    assert finding.title.endswith("of each step (TP)")
    assert "tp=4, dp=1: the exposed collectives are TP all-reduces" in "\n".join(finding.evidence)
    assert any(fix.sets[:1] == ("parallel.tp=2",) for fix in finding.fixes)
    assert_fixes_replan(run, finding)


def test_real_memory_cap_fails_an_allocation(tmp_path):
    wrapper = tmp_path / "python-capped"
    wrapper.write_text(f"#!/bin/sh\nulimit -v 2500000\nexec {sys.executable} \"$@\"\n")  # 2.4 GiB of address space
    wrapper.chmod(0o755)
    # ~230 M parameters (a 100k vocabulary, untied): the AdamW states of the first step do not fit under the cap.
    job = cpu_job(model={"preset": "tiny", "layers": 2, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
                         "vocab": 100000, "seq_len": 32},
                  parallel={"dp": 1}, train={"global_batch": 1, "micro_batch": 1, "steps": 2},
                  cluster={"gpus_per_node": 1})
    run = run_local(tmp_path, job, python=str(wrapper))
    diagnosis = diagnose_run(run)
    assert diagnosis.state == "failed"
    assert _families(diagnosis) == ["oom"]
    (finding,) = diagnosis.findings
    assert finding.severity == "error" and finding.title.startswith("host (CPU) memory exhausted")
    text = "\n".join(finding.evidence)
    assert "DefaultCPUAllocator: can't allocate memory" in text
    assert "less memory was available than planned" in text
    assert_fixes_replan(run, finding)
