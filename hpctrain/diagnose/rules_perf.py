"""Speed findings: communication share, imbalance between ranks, pipeline bubble, MFU, throughput.

Measurements come from the rank summaries (ranks/rank-R.json: means over an attempt's steps, the
warm-up step excluded) and fall back to rank 0's metrics lines. The runtime measures exposed
collective time as one figure (TP and DP waits together) and pipeline waits as `time_bubble_s`;
the split between TP and DP uses the planner's ratio for the layout.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from hpctrain.diagnose import candidates as cand
from hpctrain.diagnose.context import Context, measured_share, rank_coords, rank_host, timed_ranks
from hpctrain.diagnose.findings import WARNING, Finding, Fix, pct, ranks_text
from hpctrain.diagnose.fixes import Candidate, validated
from hpctrain.diagnose.predict import Prediction
from hpctrain.rundir.events import STARTED

FABRIC_PROFILE = {"ib-hdr200": "ib", "ib-ndr400": "ib", "roce": "roce", "ethernet": "ethernet"}


def _better(current: Optional[Prediction], key: str) -> Any:
    """accept(prediction): the fix lowers the planner's `key` share (or there is nothing to compare)."""
    def accept(p: Prediction) -> bool:
        before = getattr(current, key, None) if current is not None else None
        after = getattr(p, key, None)
        return before is None or after is None or after < before
    return accept


def _comm_dimension(ctx: Context) -> tuple[str, list[str]]:
    layout, pred = ctx.run.layout, ctx.prediction
    tp, dp = int(layout.get("tp") or 1), int(layout.get("dp") or 1)
    if tp > 1 and dp <= 1:
        return "TP", [f"tp={tp}, dp=1: the exposed collectives are TP all-reduces / all-gathers"]
    if dp > 1 and tp <= 1:
        return "DP", [f"dp={dp}, tp=1: the exposed collectives are FSDP all-gathers / reduce-scatters"]
    if tp > 1 and dp > 1 and pred is not None and (pred.tp_comm_s or pred.dp_comm_s):
        tp_s, dp_s = pred.tp_comm_s or 0.0, pred.dp_comm_s or 0.0
        main = "TP" if tp_s >= dp_s else "DP"
        return main, [f"tp={tp}, dp={dp}: the planner puts {pct(tp_s / (tp_s + dp_s))} of the collective time on TP "
                      f"and {pct(dp_s / (tp_s + dp_s))} on DP (the runtime measures them together)"]
    return "TP and DP" if tp > 1 else "collective", []


def comm_rule(ctx: Context) -> list[Finding]:
    """Exposed communication above 40 % of the step time."""
    share = measured_share(ctx.run, "time_comm_exposed_s")
    if share is None or share[0] <= ctx.thresholds.comm_share:
        return []
    dimension, lines = _comm_dimension(ctx)
    evidence = [f"exposed communication is {pct(share[0])} of the step time ({share[1]}); "
                f"threshold {pct(ctx.thresholds.comm_share)}", *lines]
    cp_kv = measured_share(ctx.run, "time_cp_kv_s")  # logged only when parallel.cp > 1
    if cp_kv is not None and cp_kv[0] > 0:
        evidence.append(f"of it the context-parallel K/V exchanges: {pct(cp_kv[0])} of the step time ({cp_kv[1]})")
    worst = max(timed_ranks(ctx.run), key=lambda r: (r.get("time_comm_exposed_s") or 0) / r["step_time_s"],
                default=None)
    if worst is not None:
        evidence.append(f"highest on rank {worst['rank']} ({rank_host(worst)}): "
                        f"{worst['time_comm_exposed_s']:.4f} s of {worst['step_time_s']:.4f} s per step")
    pred = ctx.prediction
    if pred is not None and pred.comm_share is not None:
        evidence.append(f"planner's estimate for this layout: {pct(pred.comm_share)} on {pred.label}")
    layout = ctx.run.layout
    candidates: list[Candidate] = []
    if "TP" in dimension:
        candidates += cand.fewer_tp(layout)
    if "DP" in dimension or dimension == "collective":
        candidates += cand.lower_zero(layout) + cand.more_tp(layout, ctx.gpus_per_node)
    candidates += cand.larger_micro_batch(layout)
    fixes: list[Fix] = ctx.checker.keep(candidates, _better(pred, "comm_share")) if ctx.checker else []
    fixes += _nccl_fixes(ctx)
    return [Finding("comm", WARNING, f"communication takes {pct(share[0])} of each step ({dimension})",
                    tuple(evidence), tuple(fixes))]


def _nccl_fixes(ctx: Context) -> list[Fix]:
    nccl, cluster = ctx.section("nccl"), ctx.section("cluster")
    wanted = FABRIC_PROFILE.get(str(cluster.get("fabric") or ""))
    profile = nccl.get("profile", "auto")
    if not wanted or profile == wanted or int(cluster.get("nodes") or 1) <= 1:
        return []
    fix = validated(f"NCCL settings for the {cluster.get('fabric')} fabric (nccl.profile is {profile})",
                    [f"nccl.profile={wanted}"], ctx.run.job_data)
    return [fix] if fix else []


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / max(values) if values and max(values) > 0 else 0.0


def imbalance_rule(ctx: Context) -> list[Finding]:
    """Compute time per step differing by more than 15 % between ranks (or pipeline stages)."""
    ranks = timed_ranks(ctx.run)
    if len(ranks) < 2:
        return []
    compute = {int(r["rank"]): float(r.get("time_compute_s") or 0.0) for r in ranks}
    spread = _spread(list(compute.values()))
    limit = ctx.thresholds.imbalance
    if spread <= limit:
        return []
    layout = ctx.run.layout
    fastest = min(compute.values())
    slow = sorted((r for r in compute if compute[r] > fastest * (1 + limit)), key=lambda r: -compute[r])
    by_rank = {int(r["rank"]): r for r in ranks}
    hosts = sorted({rank_host(by_rank[r]) for r in slow})
    evidence = [f"compute time per step ranges {fastest:.4f}-{max(compute.values()):.4f} s over {len(ranks)} ranks "
                f"({pct(spread)} apart; threshold {pct(limit)})",
                "slow ranks: " + ", ".join(f"{r} ({rank_host(by_rank[r])}, {compute[r]:.4f} s)" for r in slow[:8])]
    pp = int(layout.get("pp") or 1)
    stage_times: dict[int, list[float]] = {}
    for r in ranks:
        stage_times.setdefault(rank_coords(r, layout)["pp"], []).append(compute[int(r["rank"])])
    stage_mean = {s: statistics.mean(v) for s, v in stage_times.items()}
    within = max((_spread(v) for v in stage_times.values()), default=0.0)
    if pp > 1 and len(stage_mean) > 1 and _spread(list(stage_mean.values())) > limit and within <= limit:
        return [_stage_finding(ctx, stage_mean, spread, evidence)]
    fixes = []
    all_hosts = {rank_host(r) for r in ranks}
    if len(hosts) == 1 and len(all_hosts) > 1 and hosts[0] != "?":
        fix = validated(f"leave out the slow node {hosts[0]} (check its clocks, thermals and other jobs)",
                        [f"slurm.extra.exclude={hosts[0]}"], ctx.run.job_data)
        fixes = [fix] if fix else []
    title = (f"rank{'s' if len(slow) > 1 else ''} {ranks_text(slow)} {'are' if len(slow) > 1 else 'is'} {pct(spread)} "
             "slower than the fastest"
             + (f" (all on {hosts[0]})" if len(hosts) == 1 else ""))
    return [Finding("imbalance", WARNING, title, tuple(evidence), tuple(fixes))]


def _stage_finding(ctx: Context, stage_mean: dict[int, float], spread: float, evidence: list[str]) -> Finding:
    layout = ctx.run.layout
    split = _stage_layers(ctx)
    pp = int(layout.get("pp") or 1)
    for stage, seconds in sorted(stage_mean.items()):
        layers = [f"[{a}, {b})" for i, (a, b) in enumerate(split) if i % pp == stage] if split else []
        extra = " + embedding" if stage == 0 else (" + head and loss" if stage == pp - 1 else "")
        evidence.append(f"pipeline stage {stage}: layers {' '.join(layers) or '?'}{extra}: "
                        f"{seconds:.4f} s compute/step")
    slowest = max(stage_mean, key=lambda s: stage_mean[s])
    pred = ctx.prediction
    measured = pct(_spread(list(stage_mean.values())))
    ran = _flops_imbalance(ctx, split, pp)
    if ran is not None:
        evidence.append(f"the split that ran is {pct(ran)} imbalanced in training FLOPs, {measured} in measured time")
    if pred is not None and pred.stage_imbalance is not None and tuple(map(tuple, split)) != pred.stage_layers:
        evidence.append(f"the planner's balanced split for this layout is {list(map(list, pred.stage_layers))} "
                        f"({pct(pred.stage_imbalance)} in FLOPs): re-submit to get it")
    accept = (lambda p: p.stage_imbalance is None or pred is None or pred.stage_imbalance is None
              or p.stage_imbalance <= pred.stage_imbalance)
    fixes = ctx.checker.keep(cand.rebalance_pipeline(layout, ctx.layers), accept) if ctx.checker else []
    return Finding("imbalance", WARNING, f"pipeline stage {slowest} is the slowest: stages are {pct(spread)} apart",
                   tuple(evidence), tuple(fixes))


def _flops_imbalance(ctx: Context, split: list[tuple[int, int]], pp: int) -> Optional[float]:
    job = ctx.run.job
    if job is None or not split:
        return None
    from hpctrain.plan.stages import stage_imbalance

    ac = str(ctx.run.layout.get("ac") or "none")
    return float(stage_imbalance(job.model, split, pp, ac if ac in ("none", "selective", "full") else "none"))


def _stage_layers(ctx: Context) -> list[tuple[int, int]]:
    placement = ctx.section("placement")
    split = placement.get("stage_layers") or (ctx.prediction.stage_layers if ctx.prediction else ())
    return [(int(s[0]), int(s[1])) for s in split]


def bubble_rule(ctx: Context) -> list[Finding]:
    """Pipeline wait (bubble + exposed p2p) well above what the planner predicted."""
    layout = ctx.run.layout
    if int(layout.get("pp") or 1) <= 1:
        return []
    share = measured_share(ctx.run, "time_bubble_s")
    pred = ctx.prediction
    if share is None or pred is None or pred.step_time_s is None:
        return []
    predicted = (pred.bubble_s or 0.0) + (pred.pp_comm_s or 0.0)
    predicted_share = predicted / pred.step_time_s
    if share[0] <= predicted_share + ctx.thresholds.bubble_excess or share[0] <= 1.5 * predicted_share:
        return []
    micro_batches = _micro_batches(ctx)
    evidence = [f"pipeline wait is {pct(share[0])} of the step ({share[1]}); the planner predicted "
                f"{pct(predicted_share)} (bubble + p2p) for {pred.label}",
                f"pp={layout.get('pp')}, schedule {layout.get('schedule')}, "
                f"virtual stages {layout.get('virtual_stages')}"
                + (f", {micro_batches} micro-batches per step" if micro_batches else "")]
    ranks = timed_ranks(ctx.run)
    stage_compute: dict[int, list[float]] = {}
    for r in ranks:
        stage_compute.setdefault(rank_coords(r, layout)["pp"], []).append(float(r.get("time_compute_s") or 0.0))
    means = [statistics.mean(v) for v in stage_compute.values()]
    if len(means) > 1 and _spread(means) > ctx.thresholds.imbalance:
        evidence.append(f"the stages' compute differs by {pct(_spread(means))} (see the imbalance finding): the fast "
                        "stages wait for the slow one, which shows up as pipeline wait")
    candidates = cand.smaller_micro_batch(layout) + cand.interleave(layout, ctx.layers) + cand.fewer_pp(layout)
    fixes = ctx.checker.keep(candidates, _better(pred, "bubble_share")) if ctx.checker else []
    return [Finding("bubble", WARNING, f"pipeline bubble {pct(share[0])} of the step, above the planner's "
                    f"{pct(predicted_share)}", tuple(evidence), tuple(fixes))]


def _micro_batches(ctx: Context) -> Optional[int]:
    train = ctx.section("train")
    layout = ctx.run.layout
    try:
        return int(train["global_batch"]) // (int(layout["dp"]) * int(layout["micro_batch"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def mfu_rule(ctx: Context) -> list[Finding]:
    """Measured MFU far below the planner's estimate (GPU runs: MFU is null on CPU)."""
    measured = ctx.run.median_metric("mfu")
    pred = ctx.prediction
    if measured is None or pred is None or not pred.mfu or measured >= ctx.thresholds.mfu_ratio * pred.mfu:
        return []
    evidence = [f"measured MFU {pct(measured)} (median of logged steps) vs the planner's {pct(pred.mfu)} "
                f"for {pred.label}"]
    tflops, tokens = ctx.run.median_metric("tflops_per_gpu"), ctx.run.median_metric("tokens_per_s")
    if tflops is not None and pred.tflops_per_gpu:
        evidence.append(f"{tflops:.1f} TFLOP/s per GPU vs {pred.tflops_per_gpu:.1f} predicted")
    if tokens is not None and pred.tokens_per_s:
        evidence.append(f"{tokens:,.0f} tokens/s vs {pred.tokens_per_s:,.0f} predicted")
    parts = [("compute", "time_compute_s", pred.compute_s), ("exposed communication", "time_comm_exposed_s",
             (pred.tp_comm_s or 0.0) + (pred.dp_comm_s or 0.0)), ("pipeline wait", "time_bubble_s",
             (pred.bubble_s or 0.0) + (pred.pp_comm_s or 0.0))]
    worst = None
    for name, key, predicted in parts:
        got = ctx.run.median_metric(key)
        if got is not None and predicted is not None:
            evidence.append(f"{name}: {got:.4f} s per step measured vs {predicted:.4f} s predicted")
            excess = got - predicted
            worst = max(worst or (excess, name), (excess, name))
    if worst is not None:
        evidence.append(f"most of the gap is in {worst[1]}")
    fixes = [f for f in (validated("profile a few steps to see the kernels (torch profiler traces in the run dir)",
                                   ["monitor.torch_profiler=true"], ctx.run.job_data),
                         validated("or an Nsight Systems timeline of steps 10-12", ["monitor.nsys=true"],
                                   ctx.run.job_data)) if f]
    return [Finding("mfu", WARNING, f"MFU {pct(measured)} is far below the planner's {pct(pred.mfu)}",
                    tuple(evidence), tuple(fixes))]


def throughput_rule(ctx: Context) -> list[Finding]:
    """Measured tokens/s far below the planner's (< throughput_ratio of it) where MFU is not measured (the
    ranks ran on the CPU, e.g. a GPU job with runtime.allow_cpu). Not for cluster.gpu: cpu, whose planner
    figure is a rough catalog entry, not a prediction to hold a run to."""
    measured, pred = ctx.run.median_metric("tokens_per_s"), ctx.prediction
    gpu = ctx.section("cluster").get("gpu")
    if (gpu == "cpu" or measured is None or pred is None or not pred.tokens_per_s
            or ctx.run.median_metric("mfu") is not None or measured >= ctx.thresholds.throughput_ratio * pred.tokens_per_s):
        return []
    ratio = pred.tokens_per_s / max(measured, 1e-9)
    evidence = [f"{measured:,.0f} tokens/s measured (median of logged steps) vs {pred.tokens_per_s:,.0f} planned for "
                f"{pred.label} on {gpu}: {ratio:,.0f}x below the plan"]
    starts = ctx.run.events_named(STARTED)
    if starts:
        last = starts[-1]
        cuda = last.get("cuda") or "none (a CPU-only build)"
        evidence.append(f"the ranks ran on device {last.get('device', '?')} (started event, attempt "
                        f"{last.get('attempt', '?')}; torch {last.get('torch', '?')}, CUDA {cuda})")
    evidence.append("check that the ranks see their GPUs (a CUDA build of torch, CUDA_VISIBLE_DEVICES, the job's GPU "
                    "request; runtime.allow_cpu lets a GPU job train on the CPU), then the data loading and the node")
    return [Finding("throughput", WARNING, f"throughput is {ratio:,.0f}x below the planner's estimate",
                    tuple(evidence))]
