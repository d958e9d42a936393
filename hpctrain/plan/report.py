"""How a plan is shown: the JSON of one layout, the text table, the three walls, the rejections."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain.plan.memory import GIB
from hpctrain.plan.space import REASON_UNITS, REASONS

if TYPE_CHECKING:
    from hpctrain.plan.planner import PlanResult
    from hpctrain.plan.search import Layout


def layout_json(lay: Layout, model: Any) -> dict[str, Any]:
    """One entry of plan.json `layouts` (issue 4 item 7 lists the required keys)."""
    c = lay.cost
    return {
        "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "micro_batch": lay.micro_batch,
        "schedule": lay.schedule, "virtual_stages": lay.virtual_stages, "ac": lay.ac, "zero": lay.zero,
        "offload_optimizer": lay.offload_optimizer, "sequence_parallel": lay.sequence_parallel,
        "memory_gib": lay.memory.gib(),
        "memory_items_gib": {name: round(value / GIB, 3) for name, value in lay.memory.items},
        "memory_peak_phase": lay.memory.phase, "memory_peak_pp_rank": lay.peak_rank,
        "step_time_s": round(c.step_time_s, 6), "tokens_per_s": round(c.tokens_per_s, 1),
        "tflops_per_gpu": round(c.tflops_per_gpu, 2), "mfu": round(c.mfu, 4),
        "comm_share": round(c.comm_share, 4), "bubble_share": round(c.bubble_share, 4),
        "comm_bound": c.comm_bound, "comm_to_compute": round(c.comm_to_compute, 4),
        "time_s": {"compute": round(c.compute_s, 6), "tp_comm": round(c.tp_comm_s, 6),
                   "pp_comm": round(c.pp_comm_s, 6), "dp_comm_exposed": round(c.dp_comm_exposed_s, 6),
                   "bubble": round(c.bubble_s, 6), "optimizer": round(c.optimizer_s, 6),
                   "dp_comm_total": round(c.dp_comm_total_s, 6)},
        "stage_layers": [list(r) for r in lay.stage_layers], "stage_imbalance": round(lay.stage_imbalance, 4),
    }


def _schedule(lay: Layout) -> str:
    if lay.pp == 1:
        return "-"
    return lay.schedule + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")


def layouts_table(result: PlanResult, top: int) -> str:
    from tabulate import tabulate

    rows = []
    for i, lay in enumerate(result.layouts[:top], start=1):
        c = lay.cost
        rows.append([i, lay.tp, lay.pp, lay.dp, lay.micro_batch, _schedule(lay), lay.ac, lay.zero,
                     "yes" if lay.offload_optimizer else "no", f"{lay.memory.total / GIB:.1f}",
                     f"{c.tokens_per_s:,.0f}", f"{c.tflops_per_gpu:.0f}", f"{c.mfu:.1%}",
                     f"{c.comm_share:.1%}", f"{c.bubble_share:.1%}", f"{c.step_time_s:.3f}"])
    headers = ["#", "tp", "pp", "dp", "mb", "schedule", "ac", "zero", "offload", "mem GiB", "tokens/s",
               "TFLOP/s/GPU", "MFU", "comm", "bubble", "step s"]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def memory_table(lay: Layout) -> str:
    from tabulate import tabulate

    rows = [[name, f"{value / GIB:.2f}"] for name, value in lay.memory.items]
    rows.append(["total", f"{lay.memory.total / GIB:.2f}"])
    return tabulate(rows, headers=[f"memory of pp rank {lay.peak_rank} at the {lay.memory.phase} peak", "GiB"],
                    tablefmt="simple", disable_numparse=True)


def three_walls(result: PlanResult, lay: Layout) -> list[str]:
    """One line each on the memory, compute and communication walls of a layout (issue 8 item 4)."""
    m, c = lay.memory, lay.cost
    parts = {"weights": m.weights, "gradients": m.grads, "optimizer states": m.optimizer,
             "activations": m.activations, "other buffers": m.other}
    dominant = max(parts, key=lambda key: parts[key])
    budget = result.budget_bytes
    memory = (f"memory wall: {m.total / GIB:.1f} of {budget / GIB:.1f} GiB ({m.total / budget:.0%}) on pp rank "
              f"{lay.peak_rank}; {dominant} dominate ({parts[dominant] / m.total:.0%})")
    compute = (f"compute wall: {c.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {c.mfu:.1%}; compute is "
               f"{c.compute_s / c.step_time_s:.0%} of the {c.step_time_s:.3f} s step, pipeline bubble "
               f"{c.bubble_share:.1%}")
    comms = {"TP": c.tp_comm_s, "PP": c.pp_comm_s, "DP (exposed)": c.dp_comm_exposed_s}
    worst = max(comms, key=lambda key: comms[key])
    communication = (f"communication wall: {c.comm_share:.1%} of the step"
                     + (f", mostly {worst} ({comms[worst]:.3f} s)" if comms[worst] > 0 else ", none exposed"))
    if c.comm_bound:
        communication += (f"; communication-bound: collectives take {c.comm_to_compute:.1f}x the {c.compute_s:.3f} s "
                          f"of compute that could hide them, {c.comm_exposed_s:.3f} s exposed; without it the step "
                          f"would be {c.step_time_s / max(c.step_time_s - c.comm_exposed_s, 1e-12):.1f}x faster")
    return [memory, compute, communication]


def alternatives(result: PlanResult, top: int) -> list[str]:
    """Why each (tp, pp) family missing from the top rows is not there: its best layout's
    throughput relative to the best, or the reason its closest candidate was rejected."""
    best = result.best.cost.tokens_per_s
    shown = {(lay.tp, lay.pp) for lay in result.layouts[:top]}
    best_of_family: dict[tuple[int, int], Layout] = {}
    for lay in result.layouts:
        best_of_family.setdefault((lay.tp, lay.pp), lay)
    lines = []
    families = sorted(set(best_of_family) | set(result.rejected.family_reasons))
    for family in families:
        if family in shown:
            continue
        tp, pp = family
        if family in best_of_family:
            lay = best_of_family[family]
            lines.append(f"tp={tp} pp={pp}: fits, best {lay.cost.tokens_per_s / best:.0%} of the top layout's "
                         f"tokens/s ({lay.label()})")
        else:
            reason, example = result.rejected.family_reasons[family]
            lines.append(f"tp={tp} pp={pp}: rejected, {REASONS[reason]} ({example})")
    return lines


def render_text(result: PlanResult, top: int) -> str:
    """The `hpctrain plan` report."""
    hw, best = result.hardware, result.best
    out = [f"{result.job_name}: {hw.world_size} x {hw.gpu.name} ({hw.nodes} nodes x {hw.gpus_per_node}, NVLink islands "
           f"of {hw.nvlink_island_gpus}, {hw.fabric.name}); {len(result.layouts)} of {result.evaluated} candidates fit "
           f"in {result.budget_bytes / GIB:.1f} GiB ({result.rejected.counts.get('memory_over_budget', 0)} over it); "
           f"searched in {result.elapsed_s * 1000:.0f} ms", "",
           layouts_table(result, top), "", memory_table(best), ""]
    out += three_walls(result, best)
    placement = result.placement()
    out.append("")
    out.append(f"placement: stages {placement.stage_layers if best.pp > 1 else 'all layers on one stage'}; rank order "
               f"{'identity' if placement.rank_order is None else 'permuted (tp inside islands, then pp, then dp)'}; "
               f"--switches {placement.switches if placement.switches else 'not requested'}")
    if result.rejected.counts:
        out += ["", "rejected:"]
        for reason, count in sorted(result.rejected.counts.items(), key=lambda kv: -kv[1]):
            out.append(f"  {count:>6} {REASON_UNITS[reason]}: {REASONS[reason]} "
                       f"(e.g. {result.rejected.examples[reason][0]})")
    others = alternatives(result, top)
    if others:
        out += ["", "other families:"] + [f"  {line}" for line in others]
    out += [f"note: {note}" for note in result.notes]
    return "\n".join(out)
