"""Re-plan an elastic job for the nodes it actually got: `python -m hpctrain.launch.replan`.

The one deliberate exception to "no stage re-plans": a job whose `cluster.nodes` is a range
(`4-8`) learns its node count only when Slurm starts it (SLURM_JOB_NUM_NODES), first time or
requeued. The batch script runs this module on the batch host, before the ranks (torch-free, a
fraction of a second): it plans job.yaml (the job as submitted) for that count with the same global
batch (the planner fills dp, micro-batches and accumulation), rewrites job.resolved.yaml and
plan.json when the layout differs from the previous start, keeps the per-attempt copy in
submit/layouts/, and records a `layout_changed` event (old and new nodes/tp/pp/dp). The runtime then
resumes from the newest checkpoint, which DCP reshards onto the new layout.

Degrees fixed in job.yaml stay fixed: validation has checked that they fit every count of the range.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from hpctrain.config import dump_job, load_job
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.plan import resolve_job
from hpctrain.rundir.events import LAYOUT_CHANGED, append_event
from hpctrain.rundir.layout import JOB_FILE, PLAN_FILE, RESOLVED_FILE, SUBMIT_DIR, write_json, write_text
from hpctrain.rundir.layouts import LAYOUTS_DIR, describe, layout_of
from hpctrain.rundir.read import read_yaml_mapping

def replan(run_dir: Path, nodes: int, attempt: int) -> Optional[dict[str, Any]]:
    """Plan run_dir/job.yaml for `nodes` nodes; rewrite the resolved job if its layout changed.

    Returns the layout_changed event, or None when the layout stays as it was. ConfigError/PlanError
    (exit 2) when the count is outside the range or no layout fits it.
    """
    job = load_job(str(run_dir / JOB_FILE))
    counts = job.cluster.node_counts
    if nodes not in counts:
        raise ConfigError(f"SLURM_JOB_NUM_NODES: the job got {nodes} node(s), outside cluster.nodes "
                          f"{job.cluster.nodes_spec}; submit again with a range that holds it")
    sized = job.model_copy(update={"cluster": job.cluster.model_copy(update={"nodes": nodes})})
    resolved, result = resolve_job(sized)
    text = dump_job(resolved)
    (run_dir / SUBMIT_DIR / LAYOUTS_DIR).mkdir(parents=True, exist_ok=True)
    write_text(run_dir / SUBMIT_DIR / LAYOUTS_DIR / f"attempt-{attempt}.resolved.yaml", text)
    old = layout_of(read_yaml_mapping(run_dir / RESOLVED_FILE) or {})
    new = layout_of(read_yaml_mapping(run_dir / SUBMIT_DIR / LAYOUTS_DIR / f"attempt-{attempt}.resolved.yaml") or {})
    if old == new:
        return None
    write_text(run_dir / RESOLVED_FILE, text)  # the runtime, status and the doctor read the current layout here
    write_json(run_dir / PLAN_FILE, result.to_json())
    return append_event(run_dir, LAYOUT_CHANGED, attempt=attempt, old=old, new=new, source="replan")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.launch.replan", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="the run (or sweep task) directory")
    parser.add_argument("--nodes", required=True, help="nodes allocated (SLURM_JOB_NUM_NODES)")
    parser.add_argument("--attempt", default="0", help="the start's attempt number (SLURM_RESTART_COUNT)")
    args = parser.parse_args(argv)
    try:
        if not args.nodes.isdigit() or not args.attempt.isdigit():
            raise ConfigError(f"--nodes/--attempt: expected whole numbers (got {args.nodes!r}, {args.attempt!r})")
        event = replan(args.run_dir, int(args.nodes), int(args.attempt))
    except HpctrainError as exc:
        print(f"hpctrain: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # the run directory cannot be read or written: not the job's fault
        print(f"hpctrain: re-planning in {args.run_dir} failed: {exc}", file=sys.stderr)
        return 1
    if event is None:
        print(f"hpctrain: layout for {args.nodes} node(s) unchanged")
    else:
        print(f"hpctrain: layout changed: {describe(event['old'])} -> {describe(event['new'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
