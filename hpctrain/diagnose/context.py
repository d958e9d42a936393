"""What every rule gets: the run, the planner's prediction for it, the fix checker, the log matches."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from hpctrain.diagnose.fixes import FixChecker
from hpctrain.diagnose.logscan import LogMatch
from hpctrain.diagnose.predict import Prediction
from hpctrain.diagnose.rundata import RunData


@dataclass(frozen=True)
class Thresholds:
    """The field guide's rules of thumb (issue 8), overridable from `hpctrain doctor`."""

    comm_share: float = 0.40  # exposed communication / step time
    imbalance: float = 0.15  # (slowest - fastest) / slowest compute time between ranks
    stall_minutes: float = 10.0  # no new metrics line for this long (or 20 logging intervals, if longer)
    mfu_ratio: float = 0.5  # measured MFU below this fraction of the planner's estimate
    throughput_ratio: float = 0.1  # measured tokens/s below this fraction of the planner's (where MFU is not measured)
    bubble_excess: float = 0.10  # measured bubble share above the prediction by this much (absolute)
    lost_work_share: float = 0.10  # expected work lost per interruption vs time between interruptions
    val_divergence: float = 0.05  # validation loss above its best by this fraction (and rising)
    router_load: float = 3.0  # MoE: the busiest expert's tokens over the mean, on every recent logged step


@dataclass
class Context:
    run: RunData
    prediction: Optional[Prediction]
    prediction_problem: str
    checker: Optional[FixChecker]
    matches: list[LogMatch] = field(default_factory=list)
    thresholds: Thresholds = field(default_factory=Thresholds)

    @property
    def job_data(self) -> dict[str, Any]:
        return self.run.job_data or {}

    def section(self, name: str) -> dict[str, Any]:
        value = self.job_data.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def gpus_per_node(self) -> int:
        return int(self.section("cluster").get("gpus_per_node") or 1)

    @property
    def layers(self) -> int:
        job = self.run.job
        if job is not None and job.model.layers:
            return int(job.model.layers)
        return int(self.section("model").get("layers") or 1)


def rank_host(rank: dict[str, Any]) -> str:
    return str(rank.get("host") or "?")


def rank_coords(rank: dict[str, Any], layout: dict[str, Any]) -> dict[str, int]:
    """pp/dp/tp coordinates of a rank summary: as recorded, else from the rank grid
    arange(world).view(pp, dp, tp) (tp innermost: docs/architecture.md, runtime/parallel/dims.py); with
    parallel.cp > 1 arange(world).view(pp, dp, cp, tp)."""
    coords = rank.get("coords")
    if isinstance(coords, dict) and all(k in coords for k in ("pp", "dp", "tp")):
        return {k: int(coords[k]) for k in ("pp", "dp", "tp")}
    tp = int(layout.get("tp") or 1)
    dp = int(layout.get("dp") or 1)
    cp = int(layout.get("cp") or 1)
    r = int(rank["rank"])
    return {"pp": r // (dp * cp * tp), "dp": (r // (cp * tp)) % dp, "tp": r % tp}


def timed_ranks(run: RunData) -> list[dict[str, Any]]:
    """Rank summaries of the newest attempt that timed at least one step."""
    if not run.ranks:
        return []
    newest = max(int(r.get("attempt") or 0) for r in run.ranks)
    return [r for r in run.ranks if int(r.get("attempt") or 0) == newest and (r.get("steps_timed") or 0) > 0
            and isinstance(r.get("step_time_s"), (int, float)) and r["step_time_s"] > 0]


def measured_share(run: RunData, key: str) -> Optional[tuple[float, str]]:
    """(median share of step time spent in `key`, where it was measured) from rank summaries, else metrics."""
    ranks = timed_ranks(run)
    if ranks:
        shares = [float(r.get(key) or 0.0) / float(r["step_time_s"]) for r in ranks]
        return statistics.median(shares), f"median over {len(ranks)} rank(s)"
    lines = [m for m in run.steady_metrics() if isinstance(m.get("step_time_s"), (int, float)) and m["step_time_s"] > 0]
    if not lines:
        return None
    shares = [float(m.get(key) or 0.0) / float(m["step_time_s"]) for m in lines]
    return statistics.median(shares), f"median over {len(lines)} logged step(s), rank 0"
