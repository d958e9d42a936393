"""Layout changes the rules propose, as `--set` lines; `fixes.FixChecker` decides which survive.

Each function looks at the layout that ran (resolved values) and returns zero or more candidates.
Changing tp or pp moves the factor to or from dp so that tp*pp*dp stays the GPU count; changing pp
hands the schedule and virtual stages back to the planner (`auto`).
"""

from __future__ import annotations

from typing import Any

from hpctrain.diagnose.fixes import Candidate

AC_NEXT = {"none": "selective", "selective": "full"}


def _int(value: Any, default: int = 1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _dims(layout: dict[str, Any]) -> tuple[int, int, int]:
    return _int(layout.get("tp")), _int(layout.get("pp")), _int(layout.get("dp"))


def smaller_micro_batch(layout: dict[str, Any]) -> list[Candidate]:
    mb = _int(layout.get("micro_batch"))
    out = []
    for smaller in sorted({mb // 2, 1}, reverse=True):
        if 1 <= smaller < mb:
            out.append(Candidate(f"smaller micro-batch ({mb} -> {smaller}): fewer activations per forward, "
                                 "same global batch (more gradient-accumulation steps)",
                                 (f"train.micro_batch={smaller}",)))
    return out


def larger_micro_batch(layout: dict[str, Any]) -> list[Candidate]:
    mb = _int(layout.get("micro_batch"))
    return [Candidate(f"larger micro-batch ({mb} -> {2 * mb}): more compute per collective and fewer "
                      "micro-batch round trips", (f"train.micro_batch={2 * mb}",))]


def more_recompute(layout: dict[str, Any]) -> list[Candidate]:
    ac = str(layout.get("ac") or "none")
    out = []
    for mode in ("selective", "full"):
        if mode == AC_NEXT.get(ac) or (ac == "none" and mode == "full"):
            out.append(Candidate(f"activation checkpointing {ac} -> {mode}: recompute activations in backward "
                                 "instead of keeping them", (f"train.activation_checkpointing={mode}",)))
    return out


def higher_zero(layout: dict[str, Any]) -> list[Candidate]:
    _, _, dp = _dims(layout)
    zero = _int(layout.get("zero"), 0)
    if dp <= 1 or zero >= 3:
        return []
    return [Candidate(f"ZeRO {zero} -> 3: shard the weights too over dp={dp} (FSDP reshards after forward)",
                      ("parallel.zero=3",))]


def lower_zero(layout: dict[str, Any]) -> list[Candidate]:
    _, _, dp = _dims(layout)
    zero = _int(layout.get("zero"), 0)
    if dp <= 1 or zero <= 1:
        return []
    return [Candidate(f"ZeRO {zero} -> {zero - 1}: fewer parameter all-gathers / gradient reduce-scatters per "
                      "step (more memory)", (f"parallel.zero={zero - 1}",))]


def offload_optimizer(layout: dict[str, Any]) -> list[Candidate]:
    if layout.get("offload_optimizer") is True:
        return []
    return [Candidate("offload the optimizer states and step to the CPU (slower step, much less GPU memory)",
                      ("parallel.offload_optimizer=true",))]


def more_tp(layout: dict[str, Any], gpus_per_node: int) -> list[Candidate]:
    tp, _, dp = _dims(layout)
    if dp % 2 or 2 * tp > gpus_per_node:
        return []
    return [Candidate(f"tensor parallel {tp} -> {2 * tp} inside the node (dp {dp} -> {dp // 2}): split every "
                      "layer's weights and activations; fewer DP replicas per node",
                      (f"parallel.tp={2 * tp}", f"parallel.dp={dp // 2}"))]


def fewer_tp(layout: dict[str, Any]) -> list[Candidate]:
    tp, _, dp = _dims(layout)
    if tp <= 1 or tp % 2:
        return []
    return [Candidate(f"tensor parallel {tp} -> {tp // 2} (dp {dp} -> {2 * dp}): half the TP all-reduces per layer",
                      (f"parallel.tp={tp // 2}", f"parallel.dp={2 * dp}"))]


def more_pp(layout: dict[str, Any], layers: int) -> list[Candidate]:
    _, pp, dp = _dims(layout)
    if dp % 2 or 2 * pp > layers:
        return []
    return [Candidate(f"pipeline parallel {pp} -> {2 * pp} (dp {dp} -> {dp // 2}): each rank holds half the layers",
                      (f"parallel.pp={2 * pp}", f"parallel.dp={dp // 2}", "parallel.schedule=auto",
                       "parallel.virtual_stages=auto"))]


def fewer_pp(layout: dict[str, Any]) -> list[Candidate]:
    _, pp, dp = _dims(layout)
    if pp <= 1 or pp % 2:
        return []
    return [Candidate(f"pipeline parallel {pp} -> {pp // 2} (dp {dp} -> {2 * dp}): a shorter pipeline has a "
                      "smaller bubble", (f"parallel.pp={pp // 2}", f"parallel.dp={2 * dp}", "parallel.schedule=auto",
                                         "parallel.virtual_stages=auto"))]


def interleave(layout: dict[str, Any], layers: int) -> list[Candidate]:
    _, pp, _ = _dims(layout)
    v = _int(layout.get("virtual_stages"))
    if pp <= 1:
        return []
    out = []
    for more in (2 * v, v + 1):
        if more > v and pp * more <= layers:
            out.append(Candidate(f"interleaved 1F1B with {more} virtual stages per rank: the bubble shrinks "
                                 f"by 1/{more}",
                                 ("parallel.schedule=interleaved-1f1b", f"parallel.virtual_stages={more}")))
    return out


def rebalance_pipeline(layout: dict[str, Any], layers: int) -> list[Candidate]:
    """Other pipeline depths / chunkings: the planner re-splits the layers for each."""
    _, pp, dp = _dims(layout)
    out = [Candidate(f"{c.why.split(':')[0]}: " + ("no pipeline, no stages to balance" if "parallel.pp=1" in c.sets
                                                   else "the planner re-splits the layers, embedding and head into "
                                                        "stages of more even cost"), c.sets)
           for c in interleave(layout, layers) + fewer_pp(layout)]
    if dp % 2 == 0 and 2 * pp <= layers:
        out += [Candidate(f"{c.why.split(':')[0]}: smaller stages, re-split by the planner", c.sets)
                for c in more_pp(layout, layers)]
    return out
