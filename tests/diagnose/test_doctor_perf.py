"""Speed findings on recorded telemetry: communication share, imbalance, bubble, MFU."""

from __future__ import annotations

from hpctrain.config import job_from_dict
from hpctrain.diagnose.doctor import diagnose_run
from hpctrain.diagnose.predict import predict_job

from ._runs import assert_fixes_replan, event, gpu_job, healthy_telemetry, make_run, metrics_lines, rank_summary

TWO_NODES = {"nodes": 2, "gpus_per_node": 8}
PP2 = {"tp": 1, "pp": 2, "dp": 4, "schedule": "1f1b", "virtual_stages": 1}


def _only(run, family):
    findings = diagnose_run(run).findings
    assert [f.family for f in findings] == [family], [f.title for f in findings]
    return findings[0]


def test_communication_above_40_percent_names_the_dimension(tmp_path):
    job = gpu_job(cluster=TWO_NODES, parallel={"tp": 2, "dp": 8})
    metrics = metrics_lines(20, 2.2, comm_s=1.1, mfu=0.42, tflops=135.0)
    ranks = [rank_summary(r, step_time_s=2.2, comm_s=1.0 + 0.01 * r, host=f"node{1 + r // 8}") for r in range(16)]
    run = make_run(tmp_path, job, metrics=metrics, ranks=ranks)
    finding = _only(run, "comm")
    text = "\n".join(finding.evidence)
    assert finding.title.startswith("communication takes 49 % of each step")
    assert "tp=2, dp=8: the planner puts" in text and "on TP" in text
    assert "highest on rank 15 (node2)" in text
    sets = [fix.sets for fix in finding.fixes]
    assert ("nccl.profile=ib",) in sets  # two nodes over InfiniBand with nccl.profile auto
    assert len(sets) >= 2
    current = predict_job(job_from_dict(job))
    for fix in finding.fixes:
        if fix.predicted:
            assert "comm" in fix.predicted
    assert current.comm_share is not None
    assert_fixes_replan(run, finding)


def test_imbalance_names_slow_ranks_and_their_host(tmp_path):
    job = gpu_job(cluster=TWO_NODES, parallel={"tp": 1, "dp": 16}, train={"micro_batch": 1})
    ranks = [rank_summary(r, step_time_s=2.5, compute_s=2.4 if r in (9, 12) else 1.9, host=f"node{1 + r // 8}")
             for r in range(16)]
    run = make_run(tmp_path, job, metrics=metrics_lines(20, 2.5, mfu=0.42, tflops=135.0), ranks=ranks)
    finding = _only(run, "imbalance")
    assert finding.title == "ranks 9, 12 are 21 % slower than the fastest (all on node2)"
    assert "slow ranks: 9 (node2, 2.4000 s), 12 (node2, 2.4000 s)" in finding.evidence
    assert [fix.sets for fix in finding.fixes] == [("slurm.extra.exclude=node2",)]


def test_imbalanced_pipeline_stages_show_the_split(tmp_path):
    job = gpu_job(parallel=PP2)
    ranks = [rank_summary(r, step_time_s=2.4, compute_s=2.0 if r >= 4 else 1.5, bubble_s=0.2,
                          coords={"pp": r // 4, "dp": r % 4, "tp": 0}) for r in range(8)]
    run = make_run(tmp_path, job, metrics=metrics_lines(20, 2.4, bubble_s=0.2, mfu=0.42, tflops=135.0), ranks=ranks)
    finding = _only(run, "imbalance")
    assert finding.title == "pipeline stage 1 is the slowest: stages are 25 % apart"
    text = "\n".join(finding.evidence)
    assert "pipeline stage 0: layers [0, 10) + embedding: 1.5000 s" in text
    assert "pipeline stage 1: layers [10, 16) + head and loss: 2.0000 s" in text
    assert finding.fixes
    assert_fixes_replan(run, finding)


def test_bubble_above_the_planners_prediction(tmp_path):
    job = gpu_job(parallel={**PP2, "pp": 4, "dp": 2})
    metrics = metrics_lines(20, 3.0, bubble_s=1.4, mfu=0.30, tflops=100.0)
    ranks = [rank_summary(r, step_time_s=3.0, bubble_s=1.4, coords={"pp": r // 2, "dp": r % 2, "tp": 0})
             for r in range(8)]
    run = make_run(tmp_path, job, metrics=metrics, ranks=ranks)
    finding = _only(run, "bubble")
    assert finding.title.startswith("pipeline bubble 47 % of the step, above the planner's")
    assert "16 micro-batches per step" in "\n".join(finding.evidence)
    assert finding.fixes and all("bubble" in f.predicted or "comm" in f.predicted for f in finding.fixes)
    assert_fixes_replan(run, finding)


def test_mfu_far_below_the_estimate_points_at_the_gap(tmp_path):
    predicted = predict_job(job_from_dict(gpu_job()))
    step = predicted.step_time_s * 3
    metrics = metrics_lines(20, step, comm_s=0.1, mfu=predicted.mfu / 3, tflops=predicted.tflops_per_gpu / 3)
    ranks = [rank_summary(r, step_time_s=step, comm_s=0.1) for r in range(8)]
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks)
    finding = _only(run, "mfu")
    text = "\n".join(finding.evidence)
    assert "most of the gap is in compute" in text
    assert [f.sets for f in finding.fixes] == [("monitor.torch_profiler=true",), ("monitor.nsys=true",)]


def test_cpu_run_without_mfu_is_not_compared_with_a_gpu_estimate(tmp_path):
    metrics, ranks = healthy_telemetry(step_time_s=40.0, comm_s=1.0)
    for m in metrics:
        m["mfu"] = None
    run = make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks)
    # No MFU finding (nothing measured to compare); the throughput, 21x below the plan, is what says it (issue 29).
    assert [f.family for f in diagnose_run(run).findings] == ["throughput"]


def test_a_gpu_job_that_ran_on_the_cpu_is_flagged_by_its_throughput(tmp_path):
    # Issue 29: a GPU job trained on the CPU (then silently, now with runtime.allow_cpu): MFU is not measured
    # on a CPU, so only the throughput can say it. 400 tokens/s against a plan of hundreds of thousands.
    started = {"attempt": 0, "device": "cpu", "gpu": "a100-80gb", "torch": "2.13.0+cpu", "cuda": None}
    metrics = metrics_lines(20, 2.2, tokens_per_step=880)
    ranks = [rank_summary(r, step_time_s=2.2, comm_s=0.1) for r in range(8)]
    finding = _only(make_run(tmp_path, gpu_job(), metrics=metrics, ranks=ranks,
                             events=[event("started", 1.0, **started)]), "throughput")
    planned = predict_job(job_from_dict(gpu_job())).tokens_per_s
    assert finding.title == f"throughput is {planned / 400:,.0f}x below the planner's estimate"
    text = "\n".join(finding.evidence)
    assert "400 tokens/s measured" in text and f"{planned:,.0f} planned" in text
    assert "device cpu (started event, attempt 0; torch 2.13.0+cpu, CUDA none (a CPU-only build))" in text
    assert "CUDA_VISIBLE_DEVICES" in text

    # cluster.gpu: cpu: the planner's CPU figure is no prediction to hold a run to.
    cpu = gpu_job(cluster={"gpu": "cpu", "node": None, "fabric": "ethernet"})
    run = make_run(tmp_path, cpu, metrics=metrics, ranks=ranks, events=[event("started", 1.0, **started)], name="cpu")
    assert "throughput" not in [f.family for f in diagnose_run(run).findings]


def _moe_run(tmp_path, all_to_all_s, name="run"):
    """An 8-expert model at dp8 ep4 whose steps spend `all_to_all_s` of 2.0 s in the dispatch's all-to-all."""
    job = gpu_job(model={"preset": "llama3-1b", "seq_len": 4096, "moe": {"experts": 8, "top_k": 2}},
                  parallel={"tp": 1, "dp": 8, "ep": 4, "zero": 3})
    metrics = metrics_lines(20, 2.0, comm_s=all_to_all_s + 0.1, mfu=0.42, tflops=135.0)
    for line in metrics:
        line["time_all_to_all_s"] = all_to_all_s
    return make_run(tmp_path, job, metrics=metrics, name=name)


def test_an_all_to_all_above_the_communication_threshold_is_a_finding_with_fewer_ep(tmp_path):
    findings = diagnose_run(_moe_run(tmp_path, 1.0)).findings
    finding = next(f for f in findings if f.family == "all_to_all")
    assert finding.title == "the expert-parallel all-to-all takes 50 % of each step"
    assert "threshold 40 % (the communication rule's)" in "\n".join(finding.evidence)
    assert [fix.sets for fix in finding.fixes] == [("parallel.ep=2",), ("train.micro_batch=4",)]
    quiet = diagnose_run(_moe_run(tmp_path, 0.5, name="quiet")).findings  # 25 %: below the threshold
    assert "all_to_all" not in [f.family for f in quiet]


def test_the_context_parallel_kv_exchanges_are_part_of_the_communication_finding(tmp_path):
    """time_cp_kv_s (runtime/parallel/context.py's waits) is inside time_comm_exposed_s: a run whose exposed
    communication is mostly the K/V all-gathers gets the communication finding, which names their share."""
    job = gpu_job(cluster=TWO_NODES, parallel={"tp": 2, "dp": 4, "cp": 2})
    ranks = []
    for r in range(16):
        summary = rank_summary(r, step_time_s=2.0, comm_s=1.0, host=f"node{1 + r // 8}")
        summary["time_cp_kv_s"] = 0.7
        ranks.append(summary)
    run = make_run(tmp_path, job, metrics=metrics_lines(20, 2.0, comm_s=1.0, mfu=0.42, tflops=135.0), ranks=ranks)
    finding = next(f for f in diagnose_run(run).findings if f.family == "comm")
    assert finding.title.startswith("communication takes 50 % of each step")
    assert "of it the context-parallel K/V exchanges: 35 % of the step time (median over 16 rank(s))" in finding.evidence
    quiet = [rank_summary(r, step_time_s=2.0, comm_s=1.0) for r in range(16)]  # no cp: no such line
    plain = next(f for f in diagnose_run(make_run(tmp_path, job, metrics=metrics_lines(20, 2.0, comm_s=1.0), ranks=quiet,
                                                  name="plain")).findings if f.family == "comm")
    assert not any("context-parallel" in line for line in plain.evidence)
