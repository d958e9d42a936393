"""Re-check a suggested fix before the doctor prints it: apply the `--set` lines, validate, re-plan.

A fix is kept only when
- the run's resolved job (placement dropped) with the lines applied validates and the planner finds
  it fits (`plan_job` raises PlanError when nothing fits),
- its predicted memory, scaled by how much the planner under-predicted this run (measured peak /
  predicted peak, when above 1), still fits the budget, and
- the job as submitted (job.yaml, with its `auto`s) with the same lines also validates and plans,
  so the lines work after `hpctrain submit job.yaml` as well as after `hpctrain resume RUN`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from hpctrain.diagnose.findings import Fix
from hpctrain.diagnose.predict import Prediction, from_layout, pinned_job_data
from hpctrain.diagnose.predict import plan_job as default_plan_job

# Keep a margin under the budget when the planner is calibrated by a measured overshoot.
MAX_CALIBRATION = 4.0


@dataclass(frozen=True)
class Candidate:
    """A remedy to try: why it helps and its `--set` lines."""

    why: str
    sets: tuple[str, ...]


@dataclass
class FixChecker:
    """Validates and re-plans candidate fixes against a run's jobs (see the module docstring)."""

    base_data: dict[str, Any]
    submitted_data: Optional[dict[str, Any]] = None
    memory_calibration: float = 1.0
    plan_job: Callable[[Any], Any] = default_plan_job
    rejected: list[tuple[Candidate, str]] = field(default_factory=list)

    def check(self, candidate: Candidate) -> Optional[Prediction]:
        """The planner's prediction with the fix applied, or None (reason kept in `rejected`)."""
        from hpctrain.config import job_from_dict
        from hpctrain.errors import ConfigError

        try:
            job = job_from_dict(pinned_job_data(self.base_data), list(candidate.sets), origin="job.resolved.yaml")
            result = self.plan_job(job)
        except (ConfigError, ValueError) as exc:
            self.rejected.append((candidate, str(exc).splitlines()[0]))
            return None
        prediction = from_layout(result.best, float(result.budget_bytes))
        scale = min(MAX_CALIBRATION, max(1.0, self.memory_calibration))
        if prediction.budget_bytes and prediction.total_bytes * scale > prediction.budget_bytes:
            self.rejected.append((candidate, f"fits only by the planner's estimate; scaled by the measured "
                                             f"overshoot x{scale:.2f} it does not"))
            return None
        if self.submitted_data:
            try:
                self.plan_job(job_from_dict(self.submitted_data, list(candidate.sets), origin="job.yaml"))
            except (ConfigError, ValueError) as exc:
                self.rejected.append((candidate, f"job.yaml: {str(exc).splitlines()[0]}"))
                return None
        return prediction

    def keep(self, candidates: Iterable[Candidate], accept: Callable[[Prediction], bool] = lambda p: True,
             limit: int = 4) -> list[Fix]:
        """Checked fixes that `accept` likes, fastest first (planner tokens/s), at most `limit`."""
        kept: list[tuple[float, Fix]] = []
        seen: set[tuple[str, ...]] = set()
        for candidate in candidates:
            if candidate.sets in seen:
                continue
            seen.add(candidate.sets)
            prediction = self.check(candidate)
            if prediction is None or not accept(prediction):
                continue
            kept.append((-(prediction.tokens_per_s or 0.0), Fix(candidate.why, candidate.sets, prediction.summary())))
        kept.sort(key=lambda item: item[0])
        return [fix for _, fix in kept[:limit]]


def validated(why: str, sets: Iterable[str], base_data: Optional[dict[str, Any]]) -> Optional[Fix]:
    """A fix the planner cannot judge (NCCL settings, monitors, sbatch options): validate only."""
    from hpctrain.config import job_from_dict
    from hpctrain.errors import ConfigError

    lines = tuple(sets)
    if base_data is None:
        return None
    try:
        job_from_dict(pinned_job_data(base_data), list(lines))
    except ConfigError:
        return None
    return Fix(why, lines)
