"""Real runs on this machine for the doctor: the runtime on gloo/CPU ranks under the local executor.

`run_local(root, job)` plans the job, writes the run directory as `hpctrain submit` does
(job.yaml, job.resolved.yaml, plan.json, submit/, logs/), starts the local executor's supervisor
and waits for it. `stage_layers` replaces the planner's pipeline split (to make an imbalanced
one); `python` runs every process through a wrapper (e.g. one that sets `ulimit -v`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from hpctrain.config import dump_job, job_from_dict
from hpctrain.launch.local.executor import LocalExecutor
from hpctrain.launch.rundir import append_event, init_run_dir
from hpctrain.plan.planner import resolve_job

SMALL_CPU_JOB: dict[str, Any] = {
    "name": "doctor-real",
    "model": {"preset": "tiny", "layers": 4, "seq_len": 32},
    "train": {"global_batch": 8, "micro_batch": 2, "steps": 8, "precision": "fp32", "activation_checkpointing": "none",
              "log_every": 1, "optimizer": {"lr": 0.003, "weight_decay": 0.0}, "lr_schedule": {"warmup_steps": 1}},
    "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
    "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 2, "gpu": "cpu"},
    "checkpoint": {"every_steps": 100, "keep_last": 1},
}


def cpu_job(**sections: Any) -> dict[str, Any]:
    job = json.loads(json.dumps(SMALL_CPU_JOB))
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def run_local(root: Path, job_data: dict[str, Any], *, stage_layers: Optional[list[list[int]]] = None,
              python: Optional[str] = None, timeout_s: float = 240.0, name: str = "run") -> Path:
    job = job_from_dict(job_data)
    resolved, result = resolve_job(job)
    if stage_layers is not None:
        assert resolved.placement is not None
        resolved = resolved.model_copy(update={"placement": resolved.placement.model_copy(
            update={"stage_layers": stage_layers})})
    run_dir = root / name
    run_dir.mkdir(parents=True)
    init_run_dir(run_dir)
    (run_dir / "job.yaml").write_text(dump_job(job))
    (run_dir / "job.resolved.yaml").write_text(dump_job(resolved))
    (run_dir / "plan.json").write_text(json.dumps(result.to_json(top=1)))
    job_id, proc = LocalExecutor(python=python).start(run_dir, [(None, run_dir, resolved)], 1)
    append_event(run_dir, "submitted", executor="local", job_id=job_id)
    proc.wait(timeout=timeout_s)
    return run_dir
