"""How a plan is shown: the JSON of one layout, the text table, the three walls, the rejections."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain.plan.rank_setup import GIB
from hpctrain.plan.space import REASON_UNITS, REASONS

if TYPE_CHECKING:
    from hpctrain.plan.planner import PlanResult
    from hpctrain.plan.search import Layout


def layout_json(lay: Layout, model: Any) -> dict[str, Any]:
    """One entry of plan.json `layouts` (issue 4 item 7 lists the required keys)."""
    c = lay.cost
    return {
        "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep, "micro_batch": lay.micro_batch,
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
                   "dp_comm_total": round(c.dp_comm_total_s, 6), "cp_comm": round(c.cp_comm_s, 6),
                   "all_to_all": round(c.a2a_s, 6), "moe_host_sync": round(c.host_s, 6)},
        "all_to_all_crosses_nodes": c.a2a_crosses_nodes,
        "stage_layers": [list(r) for r in lay.stage_layers], "stage_imbalance": round(lay.stage_imbalance, 4),
    }


def _schedule(lay: Layout) -> str:
    if lay.pp == 1:
        return "-"
    return lay.schedule + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")


def simple_table(rows: list[list[Any]], headers: list[str]) -> str:
    """`tabulate(rows, headers, tablefmt="simple", disable_numparse=True)`, character for character (tested against it):
    each column as wide as its widest cell or its header plus two, cells left-justified and stripped, two spaces
    between columns, a dashed rule under the headers. Here because `plan` answers on the login path, where tabulate's
    import (importlib.metadata, email, html: ~20 ms) is a tenth of the whole command's fixed cost."""
    heads = [str(h) for h in headers]
    cells = [[str(c).strip() for c in row] for row in rows]
    widths = [max([len(h) + 2] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

    return "\n".join([line(heads), "  ".join("-" * w for w in widths)] + [line(row) for row in cells])


def layouts_table(result: PlanResult, top: int) -> str:
    rows: list[list[Any]] = []
    for i, lay in enumerate(result.layouts[:top], start=1):
        c = lay.cost
        rows.append([i, lay.tp, lay.pp, lay.dp, lay.micro_batch, _schedule(lay), lay.ac, lay.zero,
                     "yes" if lay.offload_optimizer else "no", f"{lay.memory.total / GIB:.1f}",
                     f"{c.tokens_per_s:,.0f}", f"{c.tflops_per_gpu:.0f}", f"{c.mfu:.1%}",
                     f"{c.comm_share:.1%}", f"{c.bubble_share:.1%}", f"{c.step_time_s:.3f}"])
    headers = ["#", "tp", "pp", "dp", "mb", "schedule", "ac", "zero", "offload", "mem GiB", "tokens/s",
               "TFLOP/s/GPU", "MFU", "comm", "bubble", "step s"]
    if any(lay.ep > 1 for lay in result.layouts[:top]):  # expert parallelism: an ep column after dp
        headers.insert(4, "ep")
        for row, lay in zip(rows, result.layouts[:top]):
            row.insert(4, lay.ep)
    if any(lay.cp > 1 for lay in result.layouts[:top]):  # context parallelism: a cp column after dp
        headers.insert(4, "cp")
        for row, lay in zip(rows, result.layouts[:top]):
            row.insert(4, lay.cp)
    return simple_table(rows, headers)


def memory_table(lay: Layout) -> str:
    rows: list[list[Any]] = [[name, f"{value / GIB:.2f}"] for name, value in lay.memory.items]
    rows.append(["total", f"{lay.memory.total / GIB:.2f}"])
    return simple_table(rows, [f"memory of pp rank {lay.peak_rank} at the {lay.memory.phase} peak", "GiB"])


# TFLOP/s counts the FLOPs the GPUs run (plan.model_stats.flops_per_token(model, ac)), recomputation
# included; MFU counts the model's FLOPs only (ac none). Said wherever the figure is printed.
_RECOMPUTE = {"none": "", "selective": " (attention recomputation included)", "full": " (recomputed forward included)"}
TFLOPS_NOTE = ("TFLOP/s/GPU counts the FLOPs the GPUs run, activation recomputation (ac) included; MFU counts the "
               "model's FLOPs only")
CPU = "cpu"  # the catalog's entry for a local CPU process (plan/hardware.py)


def machines(hw: Any) -> str:
    """The header's "(nodes x GPUs, ...)": NVLink islands and the fabric for GPUs; for CPU processes
    neither (gloo over shared memory on one node; the fabric only as the cost model's stand-in between nodes)."""
    if hw.gpu.name == CPU:
        between = f"; between nodes modelled as {hw.fabric.name}" if hw.nodes > 1 else ""
        return f"{hw.nodes} nodes x {hw.gpus_per_node} CPU processes, gloo{between}"
    domains = f", NVLink domains of {hw.nvlink_domain_gpus}" if hw.multi_node_nvlink else ""
    return f"{hw.nodes} nodes x {hw.gpus_per_node}, NVLink islands of {hw.nvlink_island_gpus}{domains}, {hw.fabric.name}"


def stages_text(stage_layers: list[Any], limit: int = 8) -> str:
    """The placement's [first, end) layer range per stage; above `limit` stages, runs of equal size
    (`96 stages over layers 0-95: 96 x 1 layer`) instead of every range."""
    ranges = [tuple(r) for r in stage_layers]
    if len(ranges) <= limit:
        return str([list(r) for r in ranges])
    runs: list[list[int]] = []  # [size, count]
    for first, end in ranges:
        if runs and runs[-1][0] == end - first:
            runs[-1][1] += 1
        else:
            runs.append([end - first, 1])
    sizes = ", ".join(f"{count} x {size} layer{'s' if size != 1 else ''}" for size, count in runs)
    return f"{len(ranges)} stages over layers {ranges[0][0]}-{ranges[-1][1] - 1}: {sizes}"


def runner_up(result: PlanResult) -> list[str]:
    """Why the top layout beats the second: the step-time part where #2 loses most, and #2's memory."""
    if len(result.layouts) < 2:
        return []
    a, b = result.layouts[0], result.layouts[1]
    parts = {"compute": lambda c: c.compute_s, "TP communication": lambda c: c.tp_comm_s,
             "PP communication": lambda c: c.pp_comm_s, "pipeline bubble": lambda c: c.bubble_s,
             "exposed DP communication": lambda c: c.dp_comm_exposed_s, "optimizer step": lambda c: c.optimizer_s,
             "all-to-all": lambda c: c.a2a_s, "MoE host syncs": lambda c: c.host_s}
    changes = sorted(((part(b.cost) - part(a.cost), name) for name, part in parts.items()), key=lambda x: -abs(x[0]))
    shown = [f"{name} {delta:+.3f} s" for delta, name in changes[:3] if abs(delta) >= 0.0005]
    memory = (f"#2 needs {b.memory.total / GIB:.1f} GiB on pp rank {b.peak_rank} (#1 {a.memory.total / GIB:.1f} GiB "
              f"of {result.budget_bytes / GIB:.1f})")
    if b.cost.tokens_per_s >= a.cost.tokens_per_s:  # a tie on throughput: the search's next keys decided
        return [f"#1 over #2 ({b.label()}): the same tokens/s; #1 is first by activation checkpointing, then memory; "
                f"{memory}"]
    return [f"#1 over #2 ({b.label()}): #2 reaches {b.cost.tokens_per_s / a.cost.tokens_per_s:.2%} of #1's tokens/s, "
            f"its step {b.cost.step_time_s - a.cost.step_time_s:.3f} s longer"
            + (f" ({', '.join(shown)})" if shown else "") + f"; {memory}"]


# What can bound a layout's step (issue 26 item 4): each a share of the step time. "dense collectives" are
# TP's and PP's on the critical path and FSDP's exposed part; CP's K/V exchanges and EP's all-to-alls apart; "MoE host
# syncs" the GPU's waits while the host launches each MoE block after reading its routing sizes (moe_cost.MOE_SYNC_HOST_S).
BOUND_PARTS = ("compute", "dense collectives", "all-to-all", "CP ring/gather", "pipeline bubble", "optimizer step",
               "MoE host syncs")
MEMORY_BOUND_SHARE = 0.90  # a best layout at >= 90 % of the budget is said to be memory-bound: its faster twins miss


def step_shares(lay: Layout) -> dict[str, float]:
    """Each BOUND_PARTS part of a layout's step, as a share of its step time."""
    c = lay.cost
    step = c.step_time_s
    return {"compute": c.compute_s / step,
            "dense collectives": (c.tp_comm_s - c.cp_comm_s + c.pp_comm_s + c.dp_comm_exposed_s) / step,
            "all-to-all": c.a2a_s / step, "CP ring/gather": c.cp_comm_s / step,
            "pipeline bubble": c.bubble_s / step, "optimizer step": c.optimizer_s / step,
            "MoE host syncs": c.host_s / step}


def shape(lay: Layout) -> tuple[int, int, int, int]:
    """A layout's shape: (tp, pp, cp, ep); dp follows from them and the GPU count."""
    return (lay.tp, lay.pp, lay.cp, lay.ep)


def next_other_shape(result: PlanResult) -> Layout | None:
    """The fastest layout whose (tp, pp, cp, ep) differs from the best's."""
    best = shape(result.best)
    return next((lay for lay in result.layouts[1:] if shape(lay) != best), None)


def _shape_text(result: PlanResult, lay: Layout) -> str:
    from hpctrain.plan.comm import ep_placement

    best = result.best
    changed = [f"{name} {getattr(best, name)}->{getattr(lay, name)}" for name in ("tp", "pp", "cp", "ep")
               if getattr(best, name) != getattr(lay, name)]
    text = ", ".join(changed)
    if lay.ep > 1:
        where = ep_placement(result.hardware, lay.tp, lay.pp, lay.ep)
        if where.crosses_fabric:
            text += f" (EP {lay.ep} across {where.nodes} nodes, all-to-all over {result.hardware.fabric.name})"
        elif where.crosses_nodes:
            text += f" (EP {lay.ep} across {where.nodes} nodes of one NVLink domain, all-to-all over NVLink)"
        else:
            text += f" (EP {lay.ep} inside a node, all-to-all over NVLink)"
    return text


def advice_json(result: PlanResult) -> dict[str, Any]:
    """What bounds the best layout and by how much, and the next-best layout of another shape."""
    best = result.best
    shares = step_shares(best)
    bound = max(shares, key=lambda key: shares[key])
    memory_share = best.memory.total / result.budget_bytes
    out: dict[str, Any] = {"bound": "memory" if memory_share >= MEMORY_BOUND_SHARE else bound,
                           "time_bound": bound, "time_bound_share": round(shares[bound], 4),
                           "shares": {key: round(value, 4) for key, value in shares.items()},
                           "memory_share": round(memory_share, 4), "alternative": None}
    alt = next_other_shape(result)
    if alt is not None:
        delta = alt.cost.step_time_s / best.cost.step_time_s - 1.0
        alt_shares = step_shares(alt)
        grew = max(BOUND_PARTS, key=lambda key: alt_shares[key] * alt.cost.step_time_s
                   - shares[key] * best.cost.step_time_s)
        out["alternative"] = {"tp": alt.tp, "pp": alt.pp, "dp": alt.dp, "cp": alt.cp, "ep": alt.ep,
                              "label": alt.label(), "step_time_s": round(alt.cost.step_time_s, 6),
                              "step_time_delta": round(delta, 4), "grew_most": grew,
                              "all_to_all_crosses_nodes": alt.cost.a2a_crosses_nodes,
                              "change": _shape_text(result, alt)}
    return out


def advice_lines(result: PlanResult) -> list[str]:
    a = advice_json(result)
    if a["bound"] == "memory":
        lines = [f"bound: memory ({a['memory_share']:.0%} of the budget); of the step, {a['time_bound']} "
                 f"{a['time_bound_share']:.0%}"]
    else:
        lines = [f"bound: {a['bound']}, {a['time_bound_share']:.0%} of the step (memory {a['memory_share']:.0%} "
                 "of the budget)"]
    alt = a["alternative"]
    if alt is not None:
        lines.append(f"next-best of another shape: {alt['change']}: {alt['step_time_delta']:+.0%} step time, "
                     f"mostly {alt['grew_most']} ({alt['label']})")
    return lines


def three_walls(result: PlanResult, lay: Layout) -> list[str]:
    """One line each on the memory, compute and communication walls of a layout (issue 8 item 4)."""
    m, c = lay.memory, lay.cost
    parts = {"weights": m.weights, "gradients": m.grads, "optimizer states": m.optimizer,
             "activations": m.activations, "other buffers": m.other}
    dominant = max(parts, key=lambda key: parts[key])
    budget = result.budget_bytes
    memory = (f"memory wall: {m.total / GIB:.1f} of {budget / GIB:.1f} GiB ({m.total / budget:.0%}) on pp rank "
              f"{lay.peak_rank}; {dominant} dominate ({parts[dominant] / m.total:.0%})")
    compute = (f"compute wall: {c.tflops_per_gpu:.0f} TFLOP/s per GPU{_RECOMPUTE[lay.ac]}, MFU {c.mfu:.1%}; compute is "
               f"{c.compute_s / c.step_time_s:.0%} of the {c.step_time_s:.3f} s step, pipeline bubble "
               f"{c.bubble_share:.1%}"
               + (f", MoE host syncs {c.host_s / c.step_time_s:.1%} ({c.host_s:.3f} s: each MoE block waits for its "
                  f"routing sizes on the host)" if c.host_s > 0 else ""))
    comms = {"TP": c.tp_comm_s - c.cp_comm_s, "CP (K/V all-gathers)": c.cp_comm_s, "PP": c.pp_comm_s,
             "DP (exposed)": c.dp_comm_exposed_s}
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
    out = [f"{result.job_name}: {hw.world_size} x {hw.gpu.name} ({machines(hw)}); {len(result.layouts)} of "
           f"{result.evaluated} candidates fit in {result.budget_bytes / GIB:.1f} GiB "
           f"({result.rejected.counts.get('memory_over_budget', 0)} over it); "
           f"searched in {result.elapsed_s * 1000:.0f} ms", "",
           layouts_table(result, top), TFLOPS_NOTE, "", memory_table(best), ""]
    out += three_walls(result, best)
    out += advice_lines(result)
    out += runner_up(result)
    placement = result.placement()
    out.append("")
    out.append(f"placement: stages {stages_text(placement.stage_layers) if best.pp > 1 else 'all layers on one stage'}; "
               f"rank order "
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
