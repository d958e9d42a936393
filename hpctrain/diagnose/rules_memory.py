"""Out of memory: CUDA OOM in the rank logs, host OOM kills (Slurm state, markers); a SIGKILL alone is only that.

The evidence compares the measured peak with the planner's prediction for the layout that ran;
the fixes (smaller micro-batch, more recomputation, a higher ZeRO stage, more TP or PP, optimizer
offload) are re-planned and kept only when they fit, even after scaling the planner's estimate by
this run's measured overshoot.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from hpctrain.diagnose import candidates as cand
from hpctrain.diagnose.context import Context, rank_host
from hpctrain.diagnose.findings import ERROR, WARNING, Finding, Fix, gib, ranks_text
from hpctrain.diagnose.fixes import Candidate
from hpctrain.diagnose.logscan import LogMatch, first_per_rank
from hpctrain.diagnose.rundata import RunData
from hpctrain.rundir.events import FAILED

KILLED_CODES = {"137", "-9", "9", "0:9", "137:0", "9:0"}
_TRIED = re.compile(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]i?B|\d+ bytes)")
_BY_TORCH = re.compile(r"([\d.]+ ?[KMGT]i?B) is allocated by PyTorch", re.IGNORECASE)
_IN_USE = re.compile(r"process has ([\d.]+ ?[KMGT]i?B) memory in use", re.IGNORECASE)


def measured_peak(run: RunData) -> Optional[tuple[float, str]]:
    """(largest peak_memory_bytes of any rank, where) from rank summaries, else rank 0's metrics."""
    best: Optional[tuple[float, str]] = None
    for rank in run.ranks:
        value = rank.get("peak_memory_bytes")
        if isinstance(value, (int, float)) and (best is None or value > best[0]):
            best = (float(value), f"rank {rank['rank']} on {rank_host(rank)}")
    if best is None:
        values = [float(m["peak_memory_bytes"]) for m in run.metrics
                  if isinstance(m.get("peak_memory_bytes"), (int, float))]
        if values:
            best = (max(values), "rank 0 (metrics)")
    return best


def _killed_reasons(ctx: Context) -> list[str]:
    """Signs of a host OOM kill outside the logs: Slurm state, exit codes, failure reasons."""
    out = []
    sched = ctx.run.scheduler
    if sched.get("state") == "OUT_OF_MEMORY":
        out.append(f"Slurm state OUT_OF_MEMORY ({sched.get('source', 'scheduler')})")
    for event in ctx.run.events_named(FAILED):
        reason = str(event.get("reason") or "")
        if re.search(r"out.of.memory|\boom", reason, re.IGNORECASE) and not re.search(r"CUDA|cuBLAS", reason,
                                                                                        re.IGNORECASE):
            out.append(f"failed event (attempt {event.get('attempt', '?')}): {reason[:200]}")
    return out


def _sigkilled(ctx: Context) -> list[str]:
    """Exit 137 / SIGKILL of a rank in a run that ended failed (the OOM killer's, or anyone's kill -9)."""
    sched = ctx.run.scheduler
    if not ctx.run.ended or sched.get("state") in ("COMPLETED", "CANCELLED"):
        return []
    out = []
    codes = [str(c) for c in sched.get("exit_codes") or []]
    if any(c in KILLED_CODES for c in codes):
        out.append(f"exit codes {', '.join(codes)} ({sched.get('source', 'scheduler')}): "
                   "a rank was killed with SIGKILL")
    for event in ctx.run.events_named(FAILED):
        reason = str(event.get("reason") or "")
        if re.search(r"(exit(ed)? with )?code (137|-9)\b|signal 9|SIGKILL", reason):
            out.append(f"failed event (attempt {event.get('attempt', '?')}): {reason[:200]}")
    return out


def _memory_evidence(ctx: Context) -> tuple[list[str], float]:
    """Lines comparing measured and predicted memory, and the calibration factor (measured/predicted)."""
    lines: list[str] = []
    peak = measured_peak(ctx.run)
    pred = ctx.prediction
    calibration = 1.0
    if peak:
        lines.append(f"measured peak {gib(peak[0])} ({peak[1]})")
    if pred is not None:
        parts = ", ".join(f"{k} {gib(pred.memory_bytes.get(k, 0.0))}" for k in ("weights", "grads", "optimizer",
                                                                               "activations", "other"))
        budget = f" of a {gib(pred.budget_bytes)} budget" if pred.budget_bytes else ""
        lines.append(f"planner predicted {gib(pred.total_bytes)}{budget} for {pred.label} ({parts})")
        if peak and pred.total_bytes > 0:
            calibration = peak[0] / pred.total_bytes
            lines.append(f"measured / predicted = {calibration:.2f}")
        if peak and pred.budget_bytes and peak[0] < 0.9 * pred.budget_bytes:
            lines.append(f"the allocation failed at {gib(peak[0])}, below the planner's {gib(pred.budget_bytes)} "
                         "budget: less memory was available than planned (a Slurm --mem or cgroup limit, a ulimit, "
                         "or other processes on the node)")
    elif ctx.prediction_problem:
        lines.append(ctx.prediction_problem)
    return lines, calibration


def _finding(ctx: Context, severity: str, title: str, lines: list[str], host: bool) -> Finding:
    evidence, calibration = _memory_evidence(ctx)
    fixes = _fixes(ctx, host=host, calibration=calibration)
    if not fixes:
        evidence.append("no layout change the planner checked lowers memory enough (more nodes, or a GPU with more "
                        "memory, are left)" if ctx.checker is not None else "no job to re-plan fixes with")
    return Finding("oom", severity, title, tuple(lines + evidence), tuple(fixes))


def _oom_candidates(ctx: Context, host: bool) -> list[Candidate]:
    layout = ctx.run.layout
    out = (cand.smaller_micro_batch(layout) + cand.more_recompute(layout) + cand.higher_zero(layout)
           + cand.more_tp(layout, ctx.gpus_per_node) + cand.more_pp(layout, ctx.layers))
    if host:
        if layout.get("offload_optimizer") is True:
            out.insert(0, Candidate("keep the optimizer on the GPU: offload puts the fp32 states in host memory",
                                    ("parallel.offload_optimizer=false",)))
    else:
        out += cand.offload_optimizer(layout)
    return out


def _fixes(ctx: Context, host: bool, calibration: float) -> list[Fix]:
    fixes: list[Fix] = []
    current = ctx.prediction.total_bytes if ctx.prediction is not None else None
    if ctx.checker is not None:
        ctx.checker.memory_calibration = calibration
        # Only changes that lower the planner's figure by 10 % or more: the rest do not address the OOM.
        fixes = ctx.checker.keep(_oom_candidates(ctx, host),
                                 lambda p: current is None or p.total_bytes <= 0.9 * current)
    mem = ctx.section("slurm").get("mem")
    if host and mem not in (None, 0, "0"):
        from hpctrain.diagnose.fixes import validated

        fix = validated(f"ask Slurm for all of the node's memory (slurm.mem is {mem})", ["slurm.mem=0"],
                        ctx.run.job_data)
        if fix:
            fixes.append(fix)
    return fixes


def _oom_lines(matches: list[LogMatch], ctx: Context) -> list[str]:
    hosts = {int(r["rank"]): rank_host(r) for r in ctx.run.ranks}
    ranks = sorted({m.rank for m in matches})
    attempts = sorted({m.attempt for m in matches})
    first = matches[0]
    lines = [f"rank(s) {ranks_text(ranks)} (host {', '.join(sorted({hosts.get(r, '?') for r in ranks}))}), "
             f"attempt(s) {', '.join(map(str, attempts))}", f"{first.where()}: {first.text[:200]}"]
    tried, in_use = _TRIED.search(first.text), _BY_TORCH.search(first.text) or _IN_USE.search(first.text)
    if tried:
        asked = tried.group(1)
        asked = gib(int(asked.split()[0])) if asked.endswith("bytes") else asked
        lines.append(f"the failing allocation asked for {asked}"
                     + (f" with {in_use.group(1)} already allocated" if in_use else ""))
    steps = [int(m["step"]) for m in ctx.run.metrics if m.get("attempt") == first.attempt]
    lines.append(f"last logged step of that attempt: {max(steps)}" if steps else "no step was logged in that attempt")
    return lines


def oom_rule(ctx: Context) -> list[Finding]:
    """CUDA OOM in logs; host OOM from markers or Slurm state; a SIGKILL of a failed run without either is
    reported as a kill (family `killed`), never as an out-of-memory."""
    findings = []
    cuda = first_per_rank(ctx.matches, "cuda_oom")
    host_marks = first_per_rank(ctx.matches, "cpu_oom")
    if cuda:
        findings.append(_finding(ctx, ERROR, "CUDA out of memory", _oom_lines(cuda, ctx), host=False))
    host_evidence = (_oom_lines(host_marks, ctx) if host_marks else []) + _killed_reasons(ctx)
    if host_evidence:
        findings.append(_finding(ctx, ERROR, "host (CPU) memory exhausted: a rank was OOM-killed or failed to "
                                 "allocate", host_evidence, host=True))
    elif not cuda:
        killed = _sigkilled(ctx)
        if killed:
            findings.append(_killed_finding(ctx, killed))
    return findings


def _killed_finding(ctx: Context, killed: list[str]) -> Finding:
    """A rank died of signal 9 and nothing the run recorded says out of memory: say what is known (the
    signal, where memory stood), not an OOM story, and offer no memory fixes (issue 29)."""
    evidence = list(killed)
    evidence.append("no out-of-memory message in the rank logs and no OUT_OF_MEMORY state from the scheduler, "
                    "so the cause is not known from the run: the kernel's OOM killer writes to the kernel log "
                    "(`dmesg`, `journalctl -k`) of the rank's host, and a `kill -9` or a node agent leaves no trace")
    peak, pred = measured_peak(ctx.run), ctx.prediction
    if peak:
        evidence.append(f"measured peak before the kill {gib(peak[0])} ({peak[1]})"
                        + (f"; the planner predicted {gib(pred.total_bytes)}" if pred is not None else ""))
    return Finding("killed", WARNING, "a rank was killed by signal 9 (SIGKILL)", tuple(evidence))


def state_bytes(rank: dict[str, Any]) -> dict[str, float]:
    """Measured weights / grads / optimizer bytes of one rank summary (runtime telemetry names)."""
    names = {"weights": ("param_bytes", "weights_bytes"), "grads": ("grad_bytes", "grads_bytes"),
             "optimizer": ("optimizer_state_bytes", "optimizer_bytes")}
    out = {}
    for component, keys in names.items():
        for key in keys:
            if isinstance(rank.get(key), (int, float)):
                out[component] = float(rank[key])
                break
    return out
