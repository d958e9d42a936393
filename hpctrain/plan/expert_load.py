"""A run's measured expert load, for `hpctrain plan --expert-load RUN_DIR`.

The busiest expert-parallel rank sets a MoE block's time (its expert GEMMs and the all-to-alls wait for it) and its
activation memory. Without a run the planner prices it at a stated default (kernels.DEFAULT_EXPERT_STEP_IMBALANCE for
the step, activations.DEFAULT_EXPERT_LOAD_IMBALANCE for memory). A MoE run of hpctrain logs, on every metrics line,
`expert_load_ep<N>` for each N > 1 dividing its experts (runtime/model/moe.py `expert_rank_loads`): the busiest of N
ranks' routed tokens over the mean, the experts placed as the runtime places them, mean over the MoE layers. This
takes the newest RECENT_LINES lines that hold them (the CLI reads metrics.jsonl backwards from its end, so a long
run's file costs the plan no more than a short one's) and takes each N's mean over them: the router as it routes lately, not
as it started.

What the figure does not see: it is the step's routing summed over every rank, so an ep group, which routes only its
own data-parallel share, is as balanced or less (fewer tokens, more noise), and one micro-batch less balanced than a
step. It prices the layouts as the run routed; a router that is still changing will route otherwise later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from hpctrain.errors import ConfigError

KEY = "expert_load_ep"  # runtime/model/moe.py EXPERT_LOAD_KEY (not imported: the planner never imports the runtime)
RECENT_LINES = 50


@dataclass(frozen=True)
class ExpertLoad:
    """Measured busiest-rank load per ep, from `lines` metrics lines of a run (steps first_step..last_step)."""

    run_dir: str
    experts: int
    by_ep: tuple[tuple[int, float], ...]
    lines: int
    first_step: int
    last_step: int

    def note(self) -> str:
        figures = ", ".join(f"ep {ep} x{load:.2f}" for ep, load in self.by_ep)
        steps = f"step {self.last_step}" if self.lines == 1 else f"steps {self.first_step}-{self.last_step}"
        return (f"expert load measured in {self.run_dir} ({steps}, {self.lines} metrics line"
                f"{'' if self.lines == 1 else 's'}): the busiest ep rank's tokens over the mean at {figures}; "
                "each layout's step time and memory priced at its own ep's figure")

    def to_json(self) -> dict[str, Any]:
        return {"source": "measured", "run_dir": self.run_dir, "lines": self.lines,
                "steps": [self.first_step, self.last_step], "by_ep": {str(ep): round(load, 4) for ep, load in self.by_ep}}


def default_note(step_default: float) -> str:
    return (f"expert load not measured: each layout with ep > 1 priced with its busiest rank at x{step_default:.2f} "
            "the mean rows (a stated default); `hpctrain plan JOB --expert-load RUN_DIR` prices it from what a run "
            "of this model routed")


def _loads(record: dict[str, Any]) -> dict[int, float]:
    out = {}
    for key, value in record.items():
        if key.startswith(KEY) and key[len(KEY):].isdigit() and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and value >= 1.0 - 1e-9:
            out[int(key[len(KEY):])] = float(value)
    return out


def read_expert_load(run_dir: str, job: Any, metrics_file: Path, records: Iterable[dict[str, Any]]) -> ExpertLoad:
    """The load measured in `run_dir` for the job's MoE model: `records` are its metrics lines newest first (the
    caller reads them: rundir/metrics.py `records_backwards`, the planner importing only config); ConfigError (one
    line, naming the option, the value and the fix) for a dense job, a run without the figures or a run of a model
    with another number of experts."""
    where = f"--expert-load {run_dir}"
    moe = job.model.moe if job.model is not None else None
    if moe is None:
        raise ConfigError(f"{where}: the job's model has no model.moe; the option prices expert parallelism "
                          "(drop it for a dense model)")
    if not Path(run_dir).is_dir():
        raise ConfigError(f"{where}: no such run directory; give the directory `hpctrain status` lists for the run")
    if not metrics_file.is_file():
        raise ConfigError(f"{where}: the run has no {metrics_file.name} yet; let it log a step first")
    found: list[tuple[int, dict[int, float]]] = []
    for record in records:
        loads = _loads(record)
        if loads:
            found.append((record["step"], loads))
        if len(found) == RECENT_LINES:
            break
    if not found:
        raise ConfigError(f"{where}: {metrics_file.name} has no {KEY}<N> figures (a dense run, or one logged by an "
                          "hpctrain without them); plan a MoE job with the run of a MoE model that logged them")
    routed, experts = max(found[0][1]), int(moe.experts)  # N = experts is always logged: every N > 1 dividing them is
    if routed != experts:
        raise ConfigError(f"{where}: the run routed over {routed} experts, the job's model.moe.experts is {experts}; "
                          "give a run of this model")
    eps = sorted(found[0][1])
    kept = [(step, loads) for step, loads in found if sorted(loads) == eps]
    by_ep = tuple((ep, sum(loads[ep] for _, loads in kept) / len(kept)) for ep in eps)
    steps = [step for step, _ in kept]
    return ExpertLoad(str(run_dir), experts, by_ep, len(kept), min(steps), max(steps))
